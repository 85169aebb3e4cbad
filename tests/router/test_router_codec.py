"""`EngineTextCodec` over the bundled model's real tokenizer (the project installs the model: a
missing one is a failed install, not a skip)."""

from __future__ import annotations

from typing import Any

import jinja2
import pytest

from router.codec import EngineTextCodec, TextCodec, load_codec
from router.config import RouterConfig

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def codec() -> TextCodec:
    return load_codec(RouterConfig())


def test_chat_template_and_eos(codec: TextCodec) -> None:
    ids = codec.encode_chat([{"role": "user", "content": "Hello!"}])
    assert ids and codec.max_model_len and codec.max_model_len >= 2048
    im_end = codec.encode("<|im_end|>")
    assert len(im_end) == 1 and im_end[0] in codec.eos_token_ids
    assert codec.vocab_size > max(ids)


def test_incremental_detokenizer_round_trip(codec: TextCodec) -> None:
    text = "Héllo, wörld! 日本語 🙂 done."
    detok = codec.detokenizer()
    out = "".join(detok.push(t) for t in codec.encode(text)) + detok.flush()
    assert out == text
    assert "".join(codec.token_text(t) for t in codec.encode("plain words")) == "plain words"


def test_template_refusal_is_a_value_error(codec: TextCodec, monkeypatch: pytest.MonkeyPatch) -> None:
    assert isinstance(codec, EngineTextCodec)

    def refuse(*_: Any, **__: Any) -> list[int]:
        raise jinja2.TemplateError("Conversation roles must alternate")

    monkeypatch.setattr(codec._tok, "encode_chat", refuse)
    with pytest.raises(ValueError, match="roles must alternate"):
        codec.encode_chat([{"role": "user", "content": "x"}])


def test_tokenize_and_detokenize_with_the_real_tokenizer(codec: TextCodec) -> None:
    from router.tokenize import DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest, detokenize, tokenize

    r = tokenize(TokenizeCompletionRequest(prompt="hello world", return_token_strs=True), codec, 2048)
    assert r.tokens == codec.encode("hello world") and r.count == len(r.tokens) and r.max_model_len == 2048
    assert r.token_strs == ["hello", "Ġworld"]  # the vocabulary's spelling, as vLLM returns it
    msgs = [{"role": "user", "content": "Hi"}]
    chat = tokenize(TokenizeChatRequest.model_validate({"messages": msgs}), codec, 2048)
    assert chat.tokens == codec.encode_chat(msgs) and chat.token_strs is None
    bare = tokenize(TokenizeChatRequest.model_validate({"messages": msgs, "add_generation_prompt": False}),
                    codec, 2048)
    assert chat.tokens[: len(bare.tokens)] == bare.tokens and len(bare.tokens) < len(chat.tokens)
    assert detokenize(DetokenizeRequest(tokens=chat.tokens), codec).prompt.startswith("<|im_start|>")
