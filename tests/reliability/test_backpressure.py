"""More concurrent requests than the decode pool holds: a bounded queue, then 429; nothing admitted lost.

A real tiny-model app whose decode pool is small on purpose: one replica, 4 sequences at a time,
4 more waiting, so the router admits 8 requests in flight (`ClusterConfig.decode_capacity_per_router`).
Every decode stream is held behind a gate (a file the test creates) until the test has seen every
answer it expects while they are held. 60 clients arrive at once: exactly 8 get a 200 and their
token 0 (from the prefill pool, so no admitted request waits for a decode slot to get it), exactly
52 are refused up front with 429 and a ``Retry-After`` (never a 200 that breaks off later). Then
the gate opens and every 200 streams exactly its tokens.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from cluster.app import compose_app
from cluster.config import ClusterConfig
from tests.support.journaled_replicas import journaled_decode
from tests.support.serve_harness import StreamResult, cluster_args, completion_body, deploy, stream_request

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(240)]

APP = "backpressure"
SEQS, QUEUE = 4, 4
N_CLIENTS = 60
MAX_TOKENS = 16
HELD_WAIT_S = 120  # for the refusals and the admitted token 0s, with every decode stream held


@pytest.fixture(scope="module")
def app(serve_base: str, tiny_model: str, tmp_path_factory: pytest.TempPathFactory
        ) -> Iterator[tuple[str, Path, int]]:
    """(URL, the gate's path, the requests the router admits at once)."""
    work = tmp_path_factory.mktemp("bp")
    gate = work / "open"
    args = cluster_args(tiny_model, decode={"max_num_seqs": SEQS, "max_queue": QUEUE},
                        limits={"token_timeout_s": 2 * HELD_WAIT_S})
    config = ClusterConfig.from_args(args)
    app = compose_app(config, decode_cls=journaled_decode(str(work), gate=str(gate)))
    with deploy(app, APP, serve_base) as u:
        yield u, gate, config.decode_capacity_per_router()


def test_overload_is_refused_up_front_and_admitted_requests_finish(app: tuple[str, Path, int]) -> None:
    url, gate, capacity = app
    assert capacity == SEQS + QUEUE
    firsts: list[str] = []

    async def burst() -> list[StreamResult]:
        async with httpx.AsyncClient(timeout=2 * HELD_WAIT_S,
                                     limits=httpx.Limits(max_connections=N_CLIENTS)) as client:
            tasks = [asyncio.create_task(stream_request(
                client, f"{url}/v1/completions", completion_body(f"client {i} wants a poem about snow", MAX_TOKENS),
                timeout_s=2 * HELD_WAIT_S, on_first=firsts.append)) for i in range(N_CLIENTS)]

            async def held() -> None:  # every refusal answered, every admitted stream at token 0
                while sum(t.done() for t in tasks) < N_CLIENTS - capacity or len(firsts) < capacity:
                    await asyncio.sleep(0.05)

            try:
                await asyncio.wait_for(held(), HELD_WAIT_S)
            finally:
                done = [t.result() for t in tasks if t.done()]
                admitted_while_held = len(firsts)
                gate.touch()  # the decode streams go on
            results = list(await asyncio.gather(*tasks))
        assert all(r.status != 200 for r in done), "a stream ended while every decode stream was held"
        assert admitted_while_held == capacity
        return results

    results = asyncio.run(burst())
    admitted = [r for r in results if r.status == 200]
    refused = [r for r in results if r.status == 429]
    other = [r for r in results if r.status not in (200, 429)]
    print(f"backpressure: {len(admitted)} admitted, {len(refused)} refused with 429, {len(other)} other")
    assert not other, [(r.status, r.error, r.transport_error) for r in other[:5]]
    assert (len(admitted), len(refused)) == (capacity, N_CLIENTS - capacity)
    broken = [r for r in admitted if not r.ok or r.usage_tokens != MAX_TOKENS]
    assert not broken, [(r.error, r.usage_tokens) for r in broken[:5]]
    for r in refused:
        assert r.error is not None and (r.error["code"], r.error["type"]) == ("rate_limit_exceeded", "rate_limit_error")
        assert int(r.headers["retry-after"]) >= 1
