"""`Generation` moving a request off a decode replica that went away, over in-process stand-ins for
Serve handles (no Ray). The oracle is the fakes' known completion (`tests.support.pd_fakes`): a
replica that dies (ActorDiedError) or hangs past the token timeout mid-stream costs the client
nothing: the same text, every token once, no error, in both modes and per choice of ``n = 2``; each
choice continues as its own decode request carrying the tokens sent; past ``migration_limit`` the
stream fails saying so; a hung stream is cancelled and nothing it holds reaches the client. Inside a
Serve request, each call the router makes is a Serve request of its own: the metadata Serve's own
builder derives for each (`ray.serve._private.default_impl.get_request_metadata`) carries the
request's id and an internal id no other call of it shares, so that the continuations of a
request's choices, routed at once, never collide in Serve's router."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from ray.serve import context as serve_context
from ray.serve._private import default_impl

from engine.sampling.sampler import SamplingParams
from router.backends import Backends
from router.generation import Delta, Generation, GenerationInput, StreamError
from router.metrics import RouterMetrics
from tests.support.fake_handles import FakeHandle
from tests.support.pd_fakes import (
    FailingDecode,
    FakeCodec,
    FakeDecode,
    FakePrefill,
    expected_choice_text,
    expected_text,
)

pytestmark = pytest.mark.timeout(30)


def setup(decode: FakeDecode, colocated: bool = False, token_timeout_s: float = 5.0, limit: int = 3
          ) -> tuple[Generation, FakeHandle, RouterMetrics]:
    dh = FakeHandle(decode)
    prefill = None if colocated else FakeHandle(FakePrefill(None))
    metrics = RouterMetrics()
    backends = Backends(prefill, dh, 5.0, token_timeout_s, 1.0)
    return Generation(backends, FakeCodec(), metrics, migration_limit=limit), dh, metrics


def inp(prompt: str, max_tokens: int, n: int = 1) -> GenerationInput:
    return GenerationInput(request_id="r1", prompt_token_ids=tuple(ord(c) for c in prompt),
                           sampling=SamplingParams(max_tokens=max_tokens, stop_token_ids=(0,)), n=n)


async def collect(gen: Generation, i: GenerationInput) -> list[Delta]:
    return [d async for d in gen.stream(i)]


def migrations(metrics: RouterMetrics, reason: str) -> float | None:
    return metrics.registry.get_sample_value("pdserve:router_migrations_total", {"reason": reason})


@pytest.mark.parametrize("colocated", [False, True])
async def test_a_dead_decode_replica_costs_the_stream_nothing(colocated: bool) -> None:
    decode = FailingDecode(failures=1, after=4)
    gen, _, metrics = setup(decode, colocated)
    deltas = await collect(gen, inp("abc", 12))
    assert "".join(d.text for d in deltas) == expected_text("abc", 12)
    assert [d.finish_reason for d in deltas] == [None] * 11 + ["length"]  # every token once, no error
    first, cont = decode.requests
    sent = [ord(c) for c in expected_text("abc", 12)][: 4 if colocated else 5]  # token 0 came from the prefill
    assert cont.request_id == "r1:m1.0" and cont.choices[0].generated == tuple(sent)
    assert cont.prompt_token_ids == first.prompt_token_ids == tuple(ord(c) for c in "abc")
    assert (cont.handle is None) == colocated
    if not colocated:  # the prefill built the KV of the prompt and the tokens sent but the last
        assert cont.handle is not None and cont.handle.n_tokens == 3 + len(sent) - 1
    assert migrations(metrics, "replica_died") == 1 and migrations(metrics, "token_timeout") == 0
    assert metrics.registry.get_sample_value("pdserve:router_migration_recomputed_tokens_total") == 3 + len(sent) - 1
    assert metrics.registry.get_sample_value("pdserve:generation_tokens_total") == 12
    assert metrics.registry.get_sample_value("pdserve:prompt_tokens_total") == 3
    assert metrics.registry.get_sample_value("pdserve:request_success_total", {"finish_reason": "length"}) == 1


async def test_each_choice_continues_on_its_own_with_its_index() -> None:
    decode = FailingDecode(failures=1, after=5)  # 5 events of 2 interleaved choices: they differ in length
    gen, _, metrics = setup(decode)
    deltas = await collect(gen, inp("abc", 10, n=2))
    for i in range(2):
        mine = [d for d in deltas if d.index == i]
        assert "".join(d.text for d in mine) == expected_choice_text("abc", 10, i)
        assert [d.finish_reason for d in mine] == [None] * 9 + ["length"]
    conts = decode.requests[1:]
    assert sorted(c.request_id for c in conts) == ["r1:m1.0", "r1:m1.1"]
    assert sorted((c.choices[0].index, len(c.choices[0].generated)) for c in conts) == [(0, 4), (1, 3)]
    assert migrations(metrics, "replica_died") == 1  # one lost stream, two continuations
    assert metrics.registry.get_sample_value("pdserve:generation_tokens_total") == 20


async def test_a_hung_replica_is_left_behind_and_never_heard_from_again() -> None:
    decode = FailingDecode(failures=1, after=3, hang=True)
    gen, _, metrics = setup(decode, token_timeout_s=0.3)
    deltas = await collect(gen, inp("abc", 10))
    assert "".join(d.text for d in deltas) == expected_text("abc", 10)
    assert sum(len(d.token_ids) for d in deltas) == 10
    assert migrations(metrics, "token_timeout") == 1
    await asyncio.sleep(0.05)
    assert decode.hung == ["r1"]  # its stream was cancelled, so whatever it would send is never read


async def test_past_the_migration_limit_the_stream_fails_saying_so() -> None:
    decode = FailingDecode(failures=10, after=1)
    gen, dh, metrics = setup(decode, limit=2)
    got: list[Delta] = []
    with pytest.raises(StreamError, match="moved 2 times already; migration_limit is 2"):
        async for d in gen.stream(inp("abc", 20)):
            got.append(d)
    assert "".join(d.text for d in got) == expected_text("abc", 4)  # token 0, then one per replica, once each
    assert len(decode.requests) == 3 and migrations(metrics, "replica_died") == 2
    await asyncio.sleep(0.05)
    assert "release" not in dh.calls  # each handle was taken by the replica that died: nothing unclaimed


async def test_no_migration_with_a_limit_of_zero() -> None:
    gen, _, metrics = setup(FailingDecode(failures=1, after=2), colocated=True, limit=0)
    with pytest.raises(StreamError, match="went away"):
        await collect(gen, inp("abc", 8))
    assert migrations(metrics, "replica_died") == 0



class MetadataHandle:
    """A handle that records, for each call, the request metadata Serve's own handle would build for
    it at ``.remote`` (`default_impl.get_request_metadata`, which reads Serve's request context), then
    makes the call on ``inner``."""

    def __init__(self, inner: Any, seen: list[tuple[str, str, str]], stream: bool = False) -> None:
        self._inner, self._seen, self._stream = inner, seen, stream

    def options(self, stream: bool = False) -> MetadataHandle:
        return MetadataHandle(self._inner.options(stream=stream), self._seen, stream)

    def __getattr__(self, name: str) -> Any:
        method, seen, stream = getattr(self._inner, name), self._seen, self._stream

        class Remote:
            def remote(self, req: Any) -> Any:
                meta = default_impl.get_request_metadata(
                    default_impl.create_init_handle_options(),
                    default_impl.create_dynamic_handle_options(method_name=name, stream=stream))
                seen.append((req.request_id, meta.request_id, meta.internal_request_id))
                return method.remote(req)

        return Remote()


@pytest.mark.parametrize("colocated", [False, True])
async def test_each_call_of_a_request_is_a_serve_request_of_its_own(colocated: bool) -> None:
    decode = FailingDecode(failures=1, after=5)  # lost mid-stream: both choices continue at once
    seen: list[tuple[str, str, str]] = []
    dh = MetadataHandle(FakeHandle(decode), seen)
    prefill = None if colocated else MetadataHandle(FakeHandle(FakePrefill(None)), seen)
    gen = Generation(Backends(prefill, dh, 5.0, 5.0, 1.0), FakeCodec(), RouterMetrics())

    async def in_request() -> list[Delta]:  # a task of its own: the Serve request context set here stays here
        serve_context._set_request_context(request_id="http-1", _internal_request_id="http-1-internal")
        outer = serve_context._get_serve_request_context()
        deltas = await collect(gen, inp("abc", 10, n=2))
        assert serve_context._get_serve_request_context() is outer  # the request's own context is untouched
        return deltas

    deltas = await asyncio.create_task(in_request())
    for i in range(2):
        assert "".join(d.text for d in deltas if d.index == i) == expected_choice_text("abc", 10, i)
    calls = [rid for rid, _, _ in seen]
    per_call = 1 if colocated else 2  # the request, then each choice moved: (a prefill and) a decode call
    assert sorted(calls) == sorted(["r1", "r1:m1.0", "r1:m1.1"] * per_call)
    assert {serve_rid for _, serve_rid, _ in seen} == {"http-1"}  # logs still follow the request
    internal = [iid for _, _, iid in seen]
    assert len(set(internal)) == len(internal) and "http-1-internal" not in internal
