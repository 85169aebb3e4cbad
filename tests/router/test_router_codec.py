"""`EngineTextCodec` over the bundled model's real tokenizer (the project installs the model: a
missing one is a failed install, not a skip), and over a tokenizer whose post-processor adds BOS
(`tests.support.bos_tokenizer`) through both endpoints' prompt building."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jinja2
import pytest

from engine.sampling.sampler import SamplingDefaults
from router.codec import EngineTextCodec, TextCodec, load_codec
from router.config import RouterConfig
from router.prompt import chat_prompt, completion_prompt, sampling_for
from router.protocol import ChatCompletionRequest, CompletionRequest
from tests.support.bos_tokenizer import BOS, BOS_ID, make_bos_tokenizer_dir

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def codec() -> TextCodec:
    return load_codec(RouterConfig())


def test_chat_template_and_eos(codec: TextCodec) -> None:
    ids = codec.encode_chat([{"role": "user", "content": "Hello!"}])
    assert ids and codec.max_model_len and codec.max_model_len >= 2048
    im_end = codec.encode_prompt("<|im_end|>")
    assert len(im_end) == 1 and im_end[0] in codec.eos_token_ids
    assert codec.vocab_size > max(ids)


def test_incremental_detokenizer_round_trip(codec: TextCodec) -> None:
    text = "Héllo, wörld! 日本語 🙂 done."
    detok = codec.detokenizer()
    out = "".join(detok.push(t) for t in codec.encode_prompt(text)) + detok.flush()
    assert out == text
    assert "".join(codec.token_text(t) for t in codec.encode_prompt("plain words")) == "plain words"


def test_template_refusal_is_a_value_error(codec: TextCodec, monkeypatch: pytest.MonkeyPatch) -> None:
    assert isinstance(codec, EngineTextCodec)

    def refuse(*_: Any, **__: Any) -> list[int]:
        raise jinja2.TemplateError("Conversation roles must alternate")

    monkeypatch.setattr(codec._tok, "encode_chat", refuse)
    with pytest.raises(ValueError, match="roles must alternate"):
        codec.encode_chat([{"role": "user", "content": "x"}])


@pytest.fixture(scope="module")
def bos_codec(tmp_path_factory: pytest.TempPathFactory) -> EngineTextCodec:
    return EngineTextCodec(make_bos_tokenizer_dir(tmp_path_factory.mktemp("bos-tokenizer")))


def test_completion_prompts_get_bos_once(bos_codec: EngineTextCodec) -> None:
    plain = bos_codec._tok.encode("Hello there")
    for prompt in ("Hello there", ["Hello there"], f"{BOS}Hello there"):
        req = CompletionRequest.model_validate({"model": "m", "prompt": prompt})
        assert completion_prompt(req, bos_codec) == (BOS_ID, *plain)
    given = [5, 6, 7]  # token ids are the client's: nothing added
    req = CompletionRequest.model_validate({"model": "m", "prompt": given})
    assert completion_prompt(req, bos_codec) == tuple(given)


def test_chat_prompt_bos_comes_from_the_template_alone(bos_codec: EngineTextCodec) -> None:
    messages = [{"role": "user", "content": "Hello"}]
    ids = chat_prompt(ChatCompletionRequest.model_validate({"model": "m", "messages": messages}), bos_codec)
    assert ids[0] == BOS_ID and ids[1] != BOS_ID
    assert ids == tuple(bos_codec._tok.encode(bos_codec._tok.apply_chat_template(messages)))


def test_codec_carries_the_models_generation_config(tmp_path: Path) -> None:
    folder = make_bos_tokenizer_dir(tmp_path)  # config.json: eos_token_id 2
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 2], "top_k": 20}))
    codec = EngineTextCodec(folder)
    assert codec.eos_token_ids == (2, 7) and codec.sampling_defaults == SamplingDefaults(top_k=20)
    req = CompletionRequest.model_validate({"model": "m", "prompt": "hi"})
    s = sampling_for(req, 3, 100, None, codec.eos_token_ids, False, codec.vocab_size,
                     defaults=codec.sampling_defaults)
    assert s.top_k == 20 and s.temperature == 1.0 and s.stop_token_ids == (2, 7)


def test_max_new_tokens_is_the_default_max_tokens(tmp_path: Path) -> None:
    """As vLLM's ``get_max_tokens`` with ``--generation-config auto``: a request's own max_tokens (or
    max_completion_tokens) wins, else the default: here the YAML's ``default_max_tokens`` where set,
    else the model's ``max_new_tokens``; either cut to what the context has left."""
    folder = make_bos_tokenizer_dir(tmp_path)
    (folder / "generation_config.json").write_text(json.dumps({"max_new_tokens": 40}))
    codec = EngineTextCodec(folder)

    def max_tokens(body: dict[str, object], room: int = 100, configured: int | None = None) -> int:
        req = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                    **body})
        return sampling_for(req, 3, 3 + room, configured, codec.eos_token_ids, False, codec.vocab_size,
                            defaults=codec.sampling_defaults).max_tokens

    assert codec.sampling_defaults.max_tokens == 40
    assert max_tokens({}) == 40
    assert max_tokens({}, room=25) == 25
    assert max_tokens({"max_tokens": 70}) == 70 and max_tokens({"max_completion_tokens": 60}) == 60
    assert max_tokens({}, configured=10) == 10
    assert sampling_for(CompletionRequest.model_validate({"model": "m", "prompt": "hi"}), 3, 103, None, (), False,
                        codec.vocab_size, defaults=codec.sampling_defaults).max_tokens == 40
    assert sampling_for(CompletionRequest.model_validate({"model": "m", "prompt": "hi"}), 3, 103, None, (), False,
                        codec.vocab_size).max_tokens == 100  # the model says nothing: the rest of the context


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
