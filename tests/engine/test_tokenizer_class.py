"""`engine.tokenizer_class`: pdserve tokenizes as transformers' AutoTokenizer does where transformers 5
builds a model-specific class over tokenizer.json (its own pre-tokenizer, normalizer and decoder), and
refuses a folder whose class it cannot mirror.

Oracle: ``transformers.AutoTokenizer`` on the same folder (the class it builds, and encode / decode on a
set of strings), and tokenizer.json loaded as saved, to show which cases the class changes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import transformers
from tokenizers import Tokenizer as HFTokenizer

from engine.errors import ModelLoadError
from engine.tokenizer import Tokenizer
from engine.tokenizer_class import GENERIC, folder_class
from tests.support.relabelled_tokenizer import make_relabelled_dir

TEXTS = [
    "def f(n):\n    Item",
    "Hello, world!  x\n\n\ny",
    "year 2024 and 3.14159",
    "I'M here's what we'll do",
    " leading space\t\ttabs\r\n",
    "café ﬁ ligature naïve",
    "你好，世界。안녕하세요",
    "<|im_start|>user\nhi there<|im_end|>\n",
    "",
]

# (model_type, declared tokenizer_class, pipeline form): each branch of AutoTokenizer's choice
CASES = [
    ("qwen2", "PreTrainedTokenizerFast", "byte_level"),  # the folder: transformers forces Qwen2Tokenizer
    ("qwen2", "GPT2Tokenizer", "bundled"),                # qwen2's declared class is ignored for the registered one
    ("qwen3", None, "byte_level"),                        # no declared class: the registered Qwen2Tokenizer
    ("qwen3", "PreTrainedTokenizerFast", "byte_level"),   # qwen3's declared class wins: generic, file as saved
    ("qwen3", "GPT2Tokenizer", "bundled"),                # ... and a model-specific one: GPT2Tokenizer
    ("llama", "GPT2Tokenizer", "bundled"),                # SmolLM2's own label: GPT-2's pipeline drops the Digits step
    ("llama", "PreTrainedTokenizerFast", "bundled"),
    ("llama", "LlamaTokenizerFast", "byte_level"),        # a Llama-3 style file under a LlamaTokenizer label: generic
    ("llama", "LlamaTokenizer", "metaspace"),             # a SentencePiece-style file: Llama's class
    ("mistral", "LlamaTokenizer", "metaspace"),           # mistral registers the generic backend
    ("phi3", "LlamaTokenizer", "metaspace"),              # phi3's declared class is ignored
    ("gemma2", None, "bundled"),                          # GemmaTokenizer over a byte-level vocabulary, as transformers
    ("gemma3_text", "GemmaTokenizerFast", "metaspace"),
    ("gemma2", "PreTrainedTokenizerFast", "bundled"),
]


def hf_class(hf: Any) -> str:
    name = type(hf).__name__
    return GENERIC if name in ("TokenizersBackend", "PreTrainedTokenizerFast") else name


def assert_same_tokens(ours: Tokenizer, hf: Any) -> None:
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == hf.encode(text, add_special_tokens=False), text
        assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True), text
        assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False), text


def test_a_qwen2_folder_with_a_plain_byte_level_file_tokenizes_as_qwen2tokenizer(tmp_path: Path) -> None:
    folder = make_relabelled_dir(tmp_path / "q", "qwen2", "PreTrainedTokenizerFast", "byte_level")
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    assert type(hf).__name__ == "Qwen2Tokenizer"
    as_saved = HFTokenizer.from_file(str(folder / "tokenizer.json")).encode("def f(n):\n    Item").ids
    assert as_saved != hf.encode("def f(n):\n    Item", add_special_tokens=False)  # the case the class changes
    assert_same_tokens(Tokenizer.from_dir(folder), hf)


@pytest.mark.parametrize(("model_type", "declared", "form"), CASES)
def test_class_and_tokens_match_autotokenizer(tmp_path: Path, model_type: str, declared: str | None,
                                              form: str) -> None:
    folder = make_relabelled_dir(tmp_path / "m", model_type, declared, form)
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    config = {"tokenizer_class": declared} if declared else {}
    assert folder_class(folder, config, (folder / "tokenizer.json").read_text()) == hf_class(hf)
    assert_same_tokens(Tokenizer.from_dir(folder), hf)


@pytest.mark.parametrize("config", [{"add_prefix_space": False}, {"legacy": True}])
def test_llama_class_options_match_autotokenizer(tmp_path: Path, config: dict[str, Any]) -> None:
    folder = make_relabelled_dir(tmp_path / "m", "llama", "LlamaTokenizer", "metaspace", **config)
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    assert type(hf).__name__ == "LlamaTokenizer"
    assert_same_tokens(Tokenizer.from_dir(folder), hf)


def test_qwen2_add_prefix_space_matches_autotokenizer(tmp_path: Path) -> None:
    folder = make_relabelled_dir(tmp_path / "m", "qwen2", None, "byte_level", add_prefix_space=True)
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    assert hf.encode("Item", add_special_tokens=False) != HFTokenizer.from_file(
        str(folder / "tokenizer.json")).encode("Item").ids  # the option reaches the pre-tokenizer
    assert_same_tokens(Tokenizer.from_dir(folder), hf)


@pytest.mark.parametrize(("model_type", "declared", "config", "match"), [
    ("llama", "CodeLlamaTokenizer", {}, "as CodeLlamaTokenizer.*mirrors only.*PreTrainedTokenizerFast"),
    ("gpt2", None, {}, "model_type 'gpt2' is not one pdserve knows"),
    ("llama", None, {"auto_map": {"AutoTokenizer": ["tok.Mine", None]}}, "auto_map names remote code"),
])
def test_a_class_pdserve_cannot_mirror_is_refused(tmp_path: Path, model_type: str, declared: str | None,
                                                  config: dict[str, Any], match: str) -> None:
    folder = make_relabelled_dir(tmp_path / "m", model_type, declared, "metaspace", **config)
    with pytest.raises(ModelLoadError, match=match):
        Tokenizer.from_dir(folder)
