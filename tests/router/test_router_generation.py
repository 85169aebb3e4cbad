"""`Generation` over in-process stand-ins for Serve handles (no Ray): the request pipeline itself."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest
from ray.exceptions import ActorDiedError

from engine.sampling.sampler import SamplingParams
from router.backends import Backends
from router.errors import APIError
from router.generation import Delta, Generation, GenerationInput, StreamError
from router.metrics import RouterMetrics
from router.objectives import Objectives, SLOClass
from router.request_objective import objective_for
from tests.support.fake_handles import FakeHandle
from tests.support.pd_fakes import (
    FIRST_LATE_S,
    FakeCodec,
    FakeDecode,
    FakePrefill,
    expected_choice_text,
    expected_text,
)

pytestmark = pytest.mark.timeout(30)


class FlakyPrefill(FakePrefill):
    def __init__(self, failures: int) -> None:
        super().__init__(None)
        self.failures = failures

    async def prefill(self, req: Any) -> Any:
        if self.failures > 0:
            self.failures -= 1
            raise ActorDiedError()
        return await super().prefill(req)


def setup(prefill: Any = "default", token_timeout_s: float = 5.0) -> tuple[Generation, FakeDecode, FakeHandle,
                                                                              RouterMetrics]:
    decode = FakeDecode(None)
    p = FakePrefill(None) if prefill == "default" else prefill
    dh = FakeHandle(decode)
    backends = Backends(FakeHandle(p) if p is not None else None, dh, 5.0, token_timeout_s, 1.0)
    metrics = RouterMetrics()
    return Generation(backends, FakeCodec(), metrics), decode, dh, metrics


def inp(prompt: str, max_tokens: int = 8, stops: tuple[str, ...] = (), rid: str = "r1", n: int = 1
        ) -> GenerationInput:
    return GenerationInput(request_id=rid, prompt_token_ids=tuple(ord(c) for c in prompt),
                           sampling=SamplingParams(max_tokens=max_tokens, stop_token_ids=(0,)),
                           stop_strings=stops, n=n)


async def collect(gen: Generation, i: GenerationInput) -> list[Delta]:
    return [d async for d in gen.stream(i)]


@pytest.mark.parametrize("colocated", [False, True])
async def test_tokens_text_and_finish(colocated: bool) -> None:
    gen, _, _dh, metrics = setup(None if colocated else "default")
    deltas = await collect(gen, inp("abc", 6))
    assert "".join(d.text for d in deltas) == expected_text("abc", 6) == "defghi"
    assert sum(len(d.token_ids) for d in deltas) == 6
    assert [d.finish_reason for d in deltas] == [None] * 5 + ["length"]
    assert deltas[0].token_ids == (ord("d"),)
    assert metrics.registry.get_sample_value("pdserve:generation_tokens_total") == 6
    ok = metrics.registry.get_sample_value("pdserve:request_success_total", {"finish_reason": "length"})
    assert ok == 1
    assert metrics.registry.get_sample_value("pdserve:time_to_first_token_seconds_count") == 1


async def test_finished_by_token_zero_never_decodes() -> None:
    gen, _, dh, _ = setup()
    deltas = await collect(gen, inp("abc", 1))
    assert [(d.text, d.finish_reason) for d in deltas] == [("d", "length")]
    assert dh.calls == []


async def test_stop_string_is_not_emitted_and_cancels_decode() -> None:
    gen, decode, dh, _ = setup()
    deltas = await collect(gen, inp("abc", 20, stops=("gh",)))
    assert "".join(d.text for d in deltas) == "def"
    assert deltas[-1].finish_reason == "stop"
    assert sum(len(d.token_ids) for d in deltas) == 5  # d e f g h: up to the token completing the stop
    await asyncio.sleep(0.05)
    assert "cancel" in dh.calls and await decode.cancelled() == ["r1"]


async def test_eos_ends_with_stop_and_no_text() -> None:
    gen, _, _, _ = setup()
    deltas = await collect(gen, inp("EOSAT3", 20))
    assert "".join(d.text for d in deltas) == "45"
    assert deltas[-1].finish_reason == "stop" and sum(len(d.token_ids) for d in deltas) == 3


async def test_error_event_raises_after_some_tokens() -> None:
    gen, _, _, _ = setup()
    got: list[Delta] = []
    with pytest.raises(StreamError, match="fake decode failure"):
        async for d in gen.stream(inp("MIDERR", 20)):
            got.append(d)
    assert len(got) == 3


async def test_prefill_retried_once_on_replica_death() -> None:
    flaky = FlakyPrefill(failures=1)
    gen, _, _, _ = setup(flaky)
    assert len(await collect(gen, inp("abc", 3))) == 3
    gen, _, _, _ = setup(FlakyPrefill(failures=2))
    with pytest.raises(APIError) as e:
        await collect(gen, inp("abc", 3))
    assert e.value.status == 503


async def test_consumer_leaving_cancels_the_decode_stream() -> None:
    gen, decode, dh, _ = setup()
    stream = gen.stream(inp("SLOW", 100))
    async for d in stream:
        if d.finish_reason is None and len(dh.calls) > 0:
            break
    await stream.aclose()
    await asyncio.sleep(0.1)
    assert await decode.cancelled() == ["r1"]


async def test_token_timeout_is_a_stream_error() -> None:
    gen, _, _, _ = setup(token_timeout_s=0.005)
    with pytest.raises(StreamError, match="no token"):
        await collect(gen, inp("SLOW", 10))


@pytest.mark.parametrize("colocated", [False, True])
async def test_a_prefill_on_the_decode_replica_is_not_a_silence(colocated: bool) -> None:
    """The first event comes FIRST_LATE_S after the call, past the token timeout. Prefilled on the
    decode replica (colocated: no KV handle) that wait is its prefill and has the prefill timeout
    more, so the stream completes; after a remote prefill (token 0 already sent) it is a silence."""
    assert 0.2 < FIRST_LATE_S < 0.2 + 5.0
    gen, _, _, metrics = setup(None if colocated else "default", token_timeout_s=0.2)
    if colocated:
        deltas = await collect(gen, inp("FIRSTLATE", 4))
        assert "".join(d.text for d in deltas) == expected_text("FIRSTLATE", 4)
        assert deltas[-1].finish_reason == "length"
    else:
        with pytest.raises(StreamError, match=r"no token from the decode pool within 0\.2 s"):
            await collect(gen, inp("FIRSTLATE", 4))
    moved = metrics.registry.get_sample_value("pdserve:router_migrations_total", {"reason": "token_timeout"})
    assert (moved or 0) == (0 if colocated else 3)


@pytest.mark.parametrize(("include", "text"), [(False, "de"), (True, "def")])
async def test_requested_stop_token_ends_the_text(include: bool, text: str) -> None:
    gen, _, _, _ = setup()
    i = GenerationInput(request_id="r1", prompt_token_ids=tuple(ord(c) for c in "abc"),
                        sampling=SamplingParams(max_tokens=20, stop_token_ids=(ord("f"),), ignore_eos=True),
                        include_stop_str=include)
    deltas = await collect(gen, i)
    assert "".join(d.text for d in deltas) == text and deltas[-1].finish_reason == "stop"


async def test_include_stop_str_in_output_keeps_the_stop_string() -> None:
    gen, _, _, _ = setup()
    i = inp("abc", 20, stops=("gh",))
    deltas = await collect(gen, GenerationInput(**{**i.__dict__, "include_stop_str": True}))
    assert "".join(d.text for d in deltas) == "defgh" and deltas[-1].finish_reason == "stop"


async def test_stop_strings_wait_for_min_tokens() -> None:
    gen, _, _, _ = setup()
    i = GenerationInput(request_id="r1", prompt_token_ids=tuple(ord(c) for c in "abc"),
                        sampling=SamplingParams(max_tokens=30, min_tokens=3, stop_token_ids=(0,)),
                        stop_strings=("e", "h"))
    deltas = await collect(gen, i)  # "e" is token 2 (too early), "h" token 5
    assert "".join(d.text for d in deltas) == "defg" and deltas[-1].finish_reason == "stop"


def by_choice(deltas: list[Delta], n: int) -> list[list[Delta]]:
    """Each choice's deltas; exactly one carries a finish reason, and it is that choice's last."""
    out = [[d for d in deltas if d.index == i] for i in range(n)]
    for mine in out:
        assert [d.finish_reason is not None for d in mine] == [False] * (len(mine) - 1) + [True]
    assert {d.index for d in deltas} == set(range(n))
    return out


@pytest.mark.parametrize("colocated", [False, True])
async def test_choices_each_have_their_text_and_all_tokens_count(colocated: bool) -> None:
    gen, _, dh, metrics = setup(None if colocated else "default")
    deltas = await collect(gen, inp("abc", 6, n=3))
    for i, mine in enumerate(by_choice(deltas, 3)):
        assert "".join(d.text for d in mine) == expected_choice_text("abc", 6, i)
    assert len(dh.calls) == 1  # one decode call for every choice
    assert metrics.registry.get_sample_value("pdserve:generation_tokens_total") == 18
    assert metrics.registry.get_sample_value("pdserve:prompt_tokens_total") == 3
    ok = metrics.registry.get_sample_value("pdserve:request_success_total", {"finish_reason": "length"})
    assert ok == 3
    gaps = sum(len(mine) - 1 for mine in by_choice(deltas, 3))  # within each choice's stream
    assert metrics.registry.get_sample_value("pdserve:inter_token_latency_seconds_count") == gaps
    timed = "request_queue_time_seconds" if colocated else "kv_transfer_time_seconds"
    assert metrics.registry.get_sample_value(f"pdserve:{timed}_count") == 1  # once per request


async def test_a_stop_string_ends_one_choice_and_the_others_go_on() -> None:
    gen, decode, _, _ = setup()
    deltas = await collect(gen, inp("abc", 6, stops=("de",), n=3))  # only choice 0 starts "de..."
    texts = ["".join(d.text for d in mine) for mine in by_choice(deltas, 3)]
    assert texts == ["", expected_choice_text("abc", 6, 1), expected_choice_text("abc", 6, 2)]
    assert [mine[-1].finish_reason for mine in by_choice(deltas, 3)] == ["stop", "length", "length"]
    assert await decode.cancelled() == []  # the decode stream ended by itself: the others ran to the end


async def test_choices_ended_by_token_zero_are_not_decoded() -> None:
    gen, _, dh, _ = setup()
    deltas = await collect(gen, inp("abc", 1, n=2))
    assert [(d.index, d.text, d.finish_reason) for d in deltas] == [(0, "d", "length"), (1, "e", "length")]
    assert dh.calls == []


class DeadlineSpy(FakePrefill):
    def __init__(self) -> None:
        super().__init__(None)
        self.deadlines: list[float | None] = []

    async def prefill(self, req: Any) -> Any:
        self.deadlines.append(req.ttft_deadline)
        return await super().prefill(req)


@pytest.mark.parametrize("colocated", [False, True])
async def test_a_request_objective_travels_to_the_prefill_and_is_judged_at_the_end(colocated: bool) -> None:
    """The class's TTFT deadline rides on the prefill call; the finished request is counted once
    under its class and its path (remote when disaggregated, local when colocated)."""
    spy = DeadlineSpy()
    gen, _, _dh, metrics = setup(None if colocated else spy)
    chat = SLOClass("chat", ttft_s=30.0, tpot_s=30.0)
    request = dataclasses.replace(inp("abc", 6), arrival_time=1000.0,
                                  objective=objective_for(Objectives((chat,)), 3, None, 1000.0))
    assert "".join(d.text for d in await collect(gen, request)) == expected_text("abc", 6)
    assert spy.deadlines == ([] if colocated else [1030.0])
    labels = {"slo_class": "chat", "path": "local" if colocated else "remote"}
    assert metrics.registry.get_sample_value("pdserve:slo_requests_total", labels | {"attained": "true"}) == 1.0
    plain = await collect(gen, inp("abc", 6, rid="r2"))  # no objective: nothing travels, nothing judged
    assert plain and spy.deadlines[1:] == ([] if colocated else [None])
    assert metrics.registry.get_sample_value("pdserve:slo_requests_total", labels | {"attained": "true"}) == 1.0
