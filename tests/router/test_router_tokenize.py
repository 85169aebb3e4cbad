"""`/tokenize` and `/detokenize` (vLLM's shapes) over the fake codec (no Ray)."""

from __future__ import annotations

import pytest

from router.errors import APIError
from router.tokenize import (
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    detokenize,
    tokenize,
)
from tests.support.pd_fakes import FakeCodec

pytestmark = pytest.mark.timeout(30)
CODEC = FakeCodec()


def test_completion_style() -> None:
    r = tokenize(TokenizeCompletionRequest(prompt="abc"), CODEC, 200)
    assert r.model_dump() == {"count": 3, "max_model_len": 200, "tokens": [97, 98, 99], "token_strs": None}
    r = tokenize(TokenizeCompletionRequest(prompt="ab", return_token_strs=True), CODEC, 200)
    assert r.token_strs == ["a", "b"]


def test_chat_style_is_the_chat_completion_prompt() -> None:
    msgs = [{"role": "user", "content": "hi"}]
    r = tokenize(TokenizeChatRequest.model_validate({"messages": msgs}), CODEC, 200)
    assert r.tokens == CODEC.encode("<user>hi<assistant>")
    r = tokenize(TokenizeChatRequest.model_validate({"messages": msgs, "add_generation_prompt": False}), CODEC, 200)
    assert r.tokens == CODEC.encode("<user>hi")
    with pytest.raises(APIError) as e:
        tokenize(TokenizeChatRequest.model_validate({"messages": [{"role": "assistant", "content": "RAISE"}]}),
                 CODEC, 200)
    assert e.value.status == 400 and e.value.param == "messages"


def test_detokenize() -> None:
    assert detokenize(DetokenizeRequest(tokens=[104, 105]), CODEC).model_dump() == {"prompt": "hi"}
    with pytest.raises(APIError) as e:
        detokenize(DetokenizeRequest(tokens=[104, 256]), CODEC)
    assert e.value.param == "tokens"
