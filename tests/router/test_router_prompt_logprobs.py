"""Prompt log-probs at the HTTP edge (no Ray): which requests ask, the shapes vLLM answers with
(completions ``echo`` + ``logprobs``: the prompt's tokens first; ``prompt_logprobs`` lists), the
stream's first chunk agreeing with the whole response, and a pool that omits them failing the request."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

import pytest
from pydantic import ValidationError

from decode_worker.types import DecodeRequest, TokenEvent
from engine.sampling.prompt_logprobs import PromptLogprobs
from engine.sampling.sampler import SamplingParams
from prefill_worker.types import PrefillRequest, PrefillResult
from router.backends import Backends
from router.errors import from_validation_errors
from router.generation import Delta, Generation, GenerationInput, StreamError
from router.metrics import RouterMetrics
from router.openai_format import ChatFormatter, CompletionFormatter
from router.protocol import ChatCompletionRequest, CompletionRequest
from tests.support.fake_handles import FakeHandle
from tests.support.pd_fakes import FakeCodec, FakeDecode, FakePrefill, fake_prompt_logprobs

pytestmark = pytest.mark.timeout(30)

PROMPT = (72, 105)  # "Hi" in the fake codec
SCORES = PromptLogprobs(token_logprobs=(-1.5,), ranks=(2,), top_ids=((33, 105, 63),),
                        top_logprobs=((-0.25, -1.5, float("-inf")),))
DELTAS = [Delta("!", (33,), (-0.5,), top_logprobs=(((33, -0.5), (46, -1.0)),), prompt_logprobs=SCORES),
          Delta("?", (63,), (-2.0,), finish_reason="length", top_logprobs=(((46, -0.75), (33, -1.25)),))]


def comp(**kw: object) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "m", "prompt": "Hi", **kw})


def test_which_requests_ask_and_which_are_refused() -> None:
    assert comp().prompt_logprobs_k is None and comp(logprobs=2).prompt_logprobs_k is None
    assert comp(echo=True, logprobs=2).prompt_logprobs_k == 2  # vLLM: echo's k is logprobs'
    assert comp(echo=True, logprobs=2, prompt_logprobs=4).prompt_logprobs_k == 4
    assert comp(prompt_logprobs=0).prompt_logprobs_k == 0
    assert comp(echo=True, logprobs=1, stream=True).prompt_logprobs_k == 1  # the first chunk carries them
    for bad in ({"prompt_logprobs": 21}, {"prompt_logprobs": -1}, {"prompt_logprobs": 0, "stream": True}):
        with pytest.raises(ValidationError) as e:
            comp(**bad)
        assert from_validation_errors(e.value.errors()).param == "prompt_logprobs"
    chat = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    assert ChatCompletionRequest.model_validate({**chat, "prompt_logprobs": 3}).prompt_logprobs == 3
    with pytest.raises(ValidationError, match="prompt_logprobs"):
        ChatCompletionRequest.model_validate({**chat, "prompt_logprobs": 1, "stream": True})


def formatter(k: int = 2) -> CompletionFormatter:
    return CompletionFormatter(model="m", codec=FakeCodec(), prompt_tokens=2, logprobs=True, top_logprobs=k,
                               echo="Hi", echo_logprobs=True, prompt_ids=PROMPT)


def test_echo_with_logprobs_puts_the_prompt_tokens_first() -> None:
    whole = formatter()
    for d in DELTAS:
        whole.add(d)
    body = whole.response().model_dump()
    choice = body["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"] == "Hi!?"
    assert lp["tokens"] == ["H", "i", "!", "?"] and lp["text_offset"] == [0, 1, 2, 3]
    assert lp["token_logprobs"] == [None, -1.5, -0.5, -2.0]
    # vLLM's: a prompt position lists its first k + 1 entries (the token, then the most likely)
    assert lp["top_logprobs"] == [None, {"i": -1.5, "!": -0.25, "?": -9999.0}, {"!": -0.5, ".": -1.0},
                                  {".": -0.75, "!": -1.25, "?": -2.0}]
    # vLLM's list: the prompt's token with its rank, then the top 3 ranked 1..3; -inf sent as -9999
    assert choice["prompt_logprobs"] == [None, {
        105: {"logprob": -1.5, "rank": 2, "decoded_token": "i"},
        33: {"logprob": -0.25, "rank": 1, "decoded_token": "!"},
        63: {"logprob": -9999.0, "rank": 3, "decoded_token": "?"}}]
    streamed = formatter()
    chunks = [streamed.chunk(d).model_dump()["choices"][0] for d in DELTAS]
    assert "prompt_logprobs" not in chunks[0]
    assert "".join(c["text"] for c in chunks) == "Hi!?"
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [x for c in chunks for x in c["logprobs"][key]] == lp[key]


def test_echo_lists_no_more_alternatives_than_logprobs_asks() -> None:
    """Three alternatives computed (``prompt_logprobs`` 3), ``logprobs`` 1: an echoed prompt token
    lists itself and the most likely one (vLLM's first k + 1 entries)."""
    one = formatter(k=1)
    for d in DELTAS:
        one.add(d)
    assert one.response().model_dump()["choices"][0]["logprobs"]["top_logprobs"][1] == {"i": -1.5, "!": -0.25}
    zero = formatter(k=0)  # logprobs 0: each token's dict holds the token alone, as vLLM answers
    for d in DELTAS:
        zero.add(dataclasses.replace(d, top_logprobs=()))  # what `Generation` sends when k is 0
    tops = zero.response().model_dump()["choices"][0]["logprobs"]["top_logprobs"]
    assert tops == [None, {"i": -1.5}, {"!": -0.5}, {"?": -2.0}]


def test_prompt_logprobs_only_where_asked() -> None:
    plain = CompletionFormatter(model="m", codec=FakeCodec(), prompt_tokens=2, logprobs=False)
    plain.add(DELTAS[1])
    assert "prompt_logprobs" not in plain.response().model_dump()["choices"][0]
    chat = ChatFormatter(model="m", codec=FakeCodec(), prompt_tokens=2, logprobs=False, prompt_ids=PROMPT)
    for d in DELTAS:
        chat.add(d)
    body = chat.response().model_dump()
    assert body["prompt_logprobs"][1][105]["rank"] == 2 and "prompt_logprobs" not in body["choices"][0]


class ForgetfulPrefill(FakePrefill):
    async def prefill(self, req: PrefillRequest) -> PrefillResult:
        return dataclasses.replace(await super().prefill(req), prompt_logprobs=None)


class ForgetfulDecode(FakeDecode):
    async def generate(self, req: DecodeRequest) -> AsyncIterator[TokenEvent]:
        async for ev in super().generate(req):
            yield dataclasses.replace(ev, prompt_logprobs=None)


def generation(colocated: bool, forgetful: bool = False) -> Generation:
    prefill = None if colocated else FakeHandle((ForgetfulPrefill if forgetful else FakePrefill)(None))
    decode = FakeHandle((ForgetfulDecode if forgetful else FakeDecode)(None))
    return Generation(Backends(prefill, decode, 5.0, 5.0, 1.0), FakeCodec(), RouterMetrics())


INPUT = GenerationInput(request_id="r", prompt_token_ids=PROMPT, sampling=SamplingParams(max_tokens=3),
                        prompt_logprobs=1)


@pytest.mark.parametrize("colocated", [False, True])
async def test_token_zero_brings_them_in_both_modes(colocated: bool) -> None:
    deltas = [d async for d in generation(colocated).stream(INPUT)]
    assert deltas[0].prompt_logprobs == fake_prompt_logprobs(PROMPT, 1)
    assert all(d.prompt_logprobs is None for d in deltas[1:])
    plain = [d async for d in generation(colocated).stream(dataclasses.replace(INPUT, prompt_logprobs=None))]
    assert all(d.prompt_logprobs is None for d in plain)


@pytest.mark.parametrize("colocated", [False, True])
async def test_a_pool_without_them_fails_the_request(colocated: bool) -> None:
    """A request that asks gets an error, never a reply without them."""
    with pytest.raises(StreamError, match="prompt log-probs"):
        _ = [d async for d in generation(colocated, forgetful=True).stream(INPUT)]
