"""The router's one-time rebuild of a lost prompt KV (`router.generation`), without Ray.

`Generation` over the in-process handle stand-ins of `tests.support.fake_handles`: a decode
replica that reports ``KV_LOST`` (its pull failed: the prefill replica died, the lease ran out)
before any decode token makes the router prefill again and resubmit once; the client's stream is
the same text it would have been. A second loss, or a loss after decode tokens, is an error.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from decode_worker.types import KV_LOST, DecodeRequest, TokenEvent
from engine.sampling.sampler import SamplingParams
from router.backends import Backends
from router.generation import Generation, GenerationInput, StreamError
from router.metrics import RouterMetrics
from tests.support.fake_handles import FakeHandle
from tests.support.pd_fakes import FakeCodec, FakeDecode, FakePrefill, expected_choice_text, expected_text

pytestmark = pytest.mark.timeout(30)


class LosingDecode(FakeDecode):
    """Fails the first ``losses`` streams with KV_LOST, after ``after_tokens`` decode tokens."""

    def __init__(self, losses: int, after_tokens: int = 0) -> None:
        super().__init__(None)
        self.losses, self.after_tokens = losses, after_tokens
        self.requests: list[DecodeRequest] = []

    async def generate(self, req: DecodeRequest) -> AsyncIterator[TokenEvent]:
        self.requests.append(req)
        if self.losses > 0:
            self.losses -= 1
            n = 0
            async for ev in super().generate(req):
                if n == self.after_tokens:
                    break
                n += 1
                yield ev
            yield TokenEvent(request_id=req.request_id, token_ids=(), finish_reason="error",
                             error="KV transfer failed: source gone", error_code=KV_LOST)
            return
        async for ev in super().generate(req):
            yield ev


def setup(decode: LosingDecode) -> tuple[Generation, FakeHandle]:
    prefill = FakeHandle(FakePrefill(None))
    return Generation(Backends(prefill, FakeHandle(decode), 5.0, 5.0, 1.0), FakeCodec(), RouterMetrics()), prefill


def request(prompt: str = "abc", n: int = 8, choices: int = 1) -> GenerationInput:
    return GenerationInput(request_id="r1", prompt_token_ids=tuple(ord(c) for c in prompt),
                           sampling=SamplingParams(max_tokens=n, stop_token_ids=(0,)), n=choices)


async def test_a_lost_kv_is_prefilled_again_once_and_the_stream_is_whole() -> None:
    decode = LosingDecode(losses=1)
    gen, prefill = setup(decode)
    deltas = [d async for d in gen.stream(request())]
    assert "".join(d.text for d in deltas) == expected_text("abc", 8)
    assert deltas[-1].finish_reason == "length" and sum(len(d.token_ids) for d in deltas) == 8
    assert prefill.calls.count("prefill") == 2 and len(decode.requests) == 2
    first, again = decode.requests
    assert again.choices == first.choices and len(first.choices) == 1 and again.handle is not None
    assert first.choices[0].first_token_id is not None


async def test_a_second_loss_is_an_error() -> None:
    gen, prefill = setup(LosingDecode(losses=2))
    with pytest.raises(StreamError, match="KV transfer failed"):
        _ = [d async for d in gen.stream(request())]
    assert prefill.calls.count("prefill") == 2


async def test_a_loss_after_decode_tokens_is_not_rebuilt() -> None:
    gen, prefill = setup(LosingDecode(losses=1, after_tokens=2))
    with pytest.raises(StreamError):
        _ = [d async for d in gen.stream(request())]
    assert prefill.calls.count("prefill") == 1


async def test_a_lost_kv_of_several_choices_is_rebuilt_once_for_all_of_them() -> None:
    decode = LosingDecode(losses=1)
    gen, prefill = setup(decode)
    deltas = [d async for d in gen.stream(request(choices=3))]
    for i in range(3):
        mine = [d for d in deltas if d.index == i]
        assert "".join(d.text for d in mine) == expected_choice_text("abc", 8, i)
        assert [d.finish_reason for d in mine].count("length") == 1 and mine[-1].finish_reason == "length"
    assert prefill.calls.count("prefill") == 2 and len(decode.requests) == 2
    first, again = decode.requests
    assert again.choices == first.choices and len(first.choices) == 3 and again.handle != first.handle
