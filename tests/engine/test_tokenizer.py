"""Tokenizer, chat template and incremental detokenizer on the bundled SmolLM2 folder.

Oracles: ``transformers.AutoTokenizer`` on the same folder (encode, decode, chat template), llama.cpp's
``smollm`` pre-tokenizer rule (every digit its own token), lossless byte-level round trips, and for the
detokenizer the one-shot ``decode`` of the whole sequence.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import transformers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.detokenizer import IncrementalDetokenizer
from engine.tokenizer import Tokenizer

TEXTS = [
    "Hello, world!",
    "",
    "I ❤️ 🦙s and 👨‍👩‍👧 families 🇫🇷",
    "你好，世界。東京は日本の首都です。안녕하세요",
    "  leading\t\ttabs\n\n\n  newlines   trailing   ",
    "numbers 1234567 and 3.14159, 1e-9",
    "def f(x):\n    return x ** 2  # comment\n",
    "<|im_start|>user\nhi there<|im_end|>\n",
    "Ünïcödé façade — naïve café ﬁ ligature, zero\u200bwidth",
]
CHATS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi 👋"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "  2+2 = ?\n"}],
    [{"role": "user", "content": "你好"}, {"role": "assistant", "content": ""}],
]


@pytest.fixture(scope="module")
def ours(smollm_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(smollm_dir)


@pytest.fixture(scope="module")
def hf(smollm_dir: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(smollm_dir)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(ours: Tokenizer, hf: Any, text: str) -> None:
    ids = ours.encode(text)
    assert ids == hf.encode(text, add_special_tokens=False)
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False) == text


def test_digits_are_split_like_llama_cpp(ours: Tokenizer) -> None:
    ids = ours.encode("year 2024")  # llama.cpp's smollm pre-tokenizer isolates every \p{N}
    assert [ours.id_to_token(i) for i in ids] == ["year", "Ġ", "2", "0", "2", "4"]


def test_special_tokens(ours: Tokenizer) -> None:
    assert ours.vocab_size == 49152
    assert ours.bos_token_id == 1 and ours.eos_token_ids == (2,) and ours.pad_token_id == 2
    assert [ours.id_to_token(i) for i in (0, 1, 2)] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert ours.encode("<|im_end|>") == [2] and ours.decode([1, 2]) == ""


@pytest.mark.parametrize("messages", CHATS)
@pytest.mark.parametrize("gen", [True, False])
def test_chat_template_matches_transformers(ours: Tokenizer, hf: Any, messages: list[Any], gen: bool) -> None:
    expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
    assert ours.apply_chat_template(messages, add_generation_prompt=gen) == expected
    ids = ours.encode_chat(messages, add_generation_prompt=gen)
    assert ids == hf.encode(expected, add_special_tokens=False)


def test_content_parts_are_joined(ours: Tokenizer, hf: Any) -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is "},
                                          {"type": "text", "text": "the capital of France?"}]}]
    joined = [{"role": "user", "content": "What is the capital of France?"}]
    assert ours.apply_chat_template(parts) == hf.apply_chat_template(joined, tokenize=False,
                                                                     add_generation_prompt=True)
    with pytest.raises(ValueError, match="text content parts"):
        ours.apply_chat_template([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}])


def test_template_errors(smollm_dir: Path, ours: Tokenizer) -> None:
    import jinja2
    from tokenizers import Tokenizer as HFTokenizer

    bare = Tokenizer(HFTokenizer.from_file(str(smollm_dir / "tokenizer.json")), {}, source="bare")
    with pytest.raises(ValueError, match="no chat template"):
        bare.apply_chat_template([{"role": "user", "content": "hi"}])
    raising = Tokenizer(bare._tok, {"chat_template": "{{ raise_exception('bad role') }}"})
    with pytest.raises(jinja2.exceptions.TemplateError, match="bad role"):
        raising.apply_chat_template([])
    as_json = Tokenizer(bare._tok, {"chat_template": "{{ messages | tojson }}"})
    assert as_json.apply_chat_template([{"role": "user", "content": "é<>"}]) == \
        '[{"role": "user", "content": "é<>"}]'  # transformers' tojson: no HTML escaping, no \\u


# ---- incremental detokenizer ----

def stream(tok: Tokenizer, ids: list[int], skip: bool = True) -> list[str]:
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    return [detok.push(i) for i in ids] + [detok.flush()]


@pytest.fixture(scope="module")
def partial_ids(ours: Tokenizer) -> list[int]:
    """Ids whose bytes are not whole UTF-8 characters on their own (pieces of emoji, CJK, ...)."""
    return [i for i in range(ours.vocab_size) if "\ufffd" in ours.decode([i])]


@pytest.mark.parametrize("text", TEXTS)
def test_stream_of_real_text_is_clean(ours: Tokenizer, text: str) -> None:
    chunks = stream(ours, ours.encode(text), skip=False)
    assert "".join(chunks) == text
    assert not any("\ufffd" in c for c in chunks)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), skip=st.booleans())
def test_stream_equals_full_decode(ours: Tokenizer, partial_ids: list[int], data: st.DataObject,
                                   skip: bool) -> None:
    token = st.one_of(st.integers(0, ours.vocab_size - 1), st.sampled_from(partial_ids), st.integers(0, 16))
    ids = data.draw(st.lists(token, max_size=40))
    full = ours.decode(ids, skip_special_tokens=skip)
    chunks = stream(ours, ids, skip)
    assert "".join(chunks) == full
    pos = 0
    for chunk in chunks[:-1]:  # pushed chunks never end on a maybe-half character
        assert not chunk.endswith("\ufffd")
        assert full[pos:pos + len(chunk)] == chunk  # so any U+FFFD inside is the full decode's own
        pos += len(chunk)


def test_window_stays_small(ours: Tokenizer) -> None:
    seen: list[int] = []

    class Counting:
        def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
            seen.append(len(ids))
            return ours.decode(ids, skip_special_tokens=skip_special_tokens)

    ids = ours.encode(" ".join(TEXTS) * 20)
    assert len(ids) > 1000
    detok = IncrementalDetokenizer(Counting())
    assert "".join(detok.push(i) for i in ids) + detok.flush() == ours.decode(ids)
    assert max(seen) <= 12  # decodes a few recent ids per token, never the whole sequence
    with pytest.raises(RuntimeError):
        detok.push(5)
