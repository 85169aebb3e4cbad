"""`Stream.next_event`: a consumer behind the step loop gets every pending token in one event, in
order, with the final event's end; a token-less end (abort, error) is never merged into tokens."""

from __future__ import annotations

import asyncio

import pytest

from decode_worker.stream import Stream
from decode_worker.types import DecodeRequest, TokenEvent, merge_events
from engine.sampling.sampler import SamplerState, SamplingParams

pytestmark = pytest.mark.timeout(30)


def _stream(logprobs: bool = True) -> Stream:
    params = SamplingParams(max_tokens=16, logprobs=logprobs)
    return Stream(req=DecodeRequest("r1", (1, 2, 3), params), sampler=SamplerState.new(params))


async def test_one_event_at_a_time_when_the_consumer_keeps_up() -> None:
    st = _stream()
    st.push(7, -0.5)
    ev = await st.next_event()
    assert ev.token_ids == (7,) and ev.logprobs == (-0.5,) and ev.finish_reason is None


async def test_pending_tokens_arrive_as_one_event_with_the_final_reason() -> None:
    st = _stream()
    for i, tok in enumerate((5, 6, 7)):
        st.push(tok, -float(i))
    st.push(8, -3.0, "length")
    ev = await st.next_event()
    assert ev.token_ids == (5, 6, 7, 8)
    assert ev.logprobs == (-0.0, -1.0, -2.0, -3.0)
    assert ev.finish_reason == "length" and ev.timings is not None
    assert not st.pending


async def test_an_error_end_is_not_merged_into_the_tokens_before_it() -> None:
    st = _stream(logprobs=False)
    st.push(5, -1.0)
    st.push(6, -1.0)
    st.close("error", "boom", "kv_lost")
    first = await st.next_event()
    assert first.token_ids == (5, 6) and first.logprobs is None and first.finish_reason is None
    end = await st.next_event()
    assert end.token_ids == () and end.finish_reason == "error" and end.error_code == "kv_lost"


async def test_next_event_waits_for_a_push_and_survives_cancellation() -> None:
    st = _stream()
    waiter = asyncio.ensure_future(st.next_event())
    await asyncio.sleep(0.01)
    assert not waiter.done()
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    st.push(9, -0.1)  # nothing was taken by the cancelled wait
    assert (await asyncio.wait_for(st.next_event(), 5)).token_ids == (9,)


def test_merge_events_drops_logprobs_unless_every_event_has_them() -> None:
    a = TokenEvent("r", (1,), (-1.0,))
    b = TokenEvent("r", (2,), None, finish_reason="stop")
    merged = merge_events([a, b])
    assert merged.token_ids == (1, 2) and merged.logprobs is None and merged.finish_reason == "stop"
