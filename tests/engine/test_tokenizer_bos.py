"""BOS on completion prompts: what the tokenizer's post-processor adds, never doubled; chats untouched.

Oracle: transformers' ``PreTrainedTokenizerFast`` on the same files (``tokenizer(text)`` for a
completion prompt, the rendered template encoded without special tokens for a chat, as vLLM does).
One tokenizer adds BOS (Llama-3 style, `tests.support.bos_tokenizer`), the bundled SmolLM2 adds nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import transformers

from engine.tokenizer import Tokenizer
from tests.support.bos_tokenizer import BOS, BOS_ID, make_bos_tokenizer_dir

TEXTS = ["Hello, world!", " leading space", "I ❤️ 🦙s", "<|im_start|>user\nhi<|im_end|>\n", "a"]


@pytest.fixture(scope="module")
def bos_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_bos_tokenizer_dir(tmp_path_factory.mktemp("bos-tokenizer"))


@pytest.fixture(scope="module")
def hf(bos_dir: Path) -> Any:
    tok = transformers.AutoTokenizer.from_pretrained(bos_dir)
    assert isinstance(tok, transformers.PreTrainedTokenizerFast)
    return tok


@pytest.mark.parametrize("text", TEXTS)
def test_completion_prompt_gets_the_post_processors_bos(bos_dir: Path, hf: Any, text: str) -> None:
    ids = Tokenizer.from_dir(bos_dir).encode_prompt(text)
    assert ids == hf(text)["input_ids"]
    assert ids[0] == BOS_ID and ids[1:] == hf.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", [f"{BOS}Hello", f"{BOS} Hello", f"{BOS}"])
def test_bos_already_in_the_text_is_not_doubled(bos_dir: Path, hf: Any, text: str) -> None:
    ids = Tokenizer.from_dir(bos_dir).encode_prompt(text)
    assert ids == hf.encode(text, add_special_tokens=False)  # the text's own BOS, once
    assert hf(text)["input_ids"][:2] == [BOS_ID, BOS_ID]  # what transformers would have sent
    assert ids[0] == BOS_ID and ids[1:2] != [BOS_ID]


def test_chat_template_decides(bos_dir: Path, hf: Any) -> None:
    messages = [{"role": "user", "content": "What is 2+2?"}]
    ours = Tokenizer.from_dir(bos_dir)
    text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(messages) == text and text.startswith(BOS)
    ids = ours.encode_chat(messages)
    assert ids == hf.encode(text, add_special_tokens=False)
    assert ids[0] == BOS_ID and ids[1] != BOS_ID


@pytest.mark.parametrize("text", TEXTS)
def test_smollm2_adds_nothing(smollm_dir: Path, text: str) -> None:
    hf_tok = transformers.AutoTokenizer.from_pretrained(smollm_dir)
    ours = Tokenizer.from_dir(smollm_dir)
    assert ours.encode_prompt(text) == ours.encode(text) == hf_tok(text)["input_ids"]
