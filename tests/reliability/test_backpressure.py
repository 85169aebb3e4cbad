"""More concurrent requests than the decode pool holds: a bounded queue, then 429; nothing admitted lost.

A real tiny-model app whose decode pool is small on purpose: one replica, 4 sequences at a time,
4 more waiting, 100 ms between streamed events (so every stream holds its slot for over 1.5 s).
60 clients arrive at once. The pool can hold 8 of them; the rest must be refused up front with 429
and a ``Retry-After`` (never a 200 that breaks off later), every 200 must stream exactly its
tokens, and token 0 of an admitted request must not wait for the queue ahead of it to drain.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

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
EVENT_DELAY_S = 0.1


@pytest.fixture(scope="module")
def url(serve_base: str, tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    args = cluster_args(tiny_model, decode={"max_num_seqs": SEQS, "max_queue": QUEUE},
                        limits={"token_timeout_s": 30})
    app = compose_app(ClusterConfig.from_args(args),
                      decode_cls=journaled_decode(str(tmp_path_factory.mktemp("bp")), EVENT_DELAY_S))
    with deploy(app, APP, serve_base) as u:
        yield u


def test_overload_is_refused_up_front_and_admitted_requests_finish(url: str) -> None:
    async def burst() -> list[StreamResult]:
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=N_CLIENTS)) as client:
            return list(await asyncio.gather(*(stream_request(
                client, f"{url}/v1/completions", completion_body(f"client {i} wants a poem about snow", MAX_TOKENS),
                timeout_s=120) for i in range(N_CLIENTS))))

    t0 = time.monotonic()
    results = asyncio.run(burst())
    elapsed = time.monotonic() - t0
    admitted = [r for r in results if r.status == 200]
    refused = [r for r in results if r.status == 429]
    other = [r for r in results if r.status not in (200, 429)]
    ttfts = sorted(r.ttft for r in admitted if r.ttft is not None)
    print(f"backpressure: {len(admitted)} admitted, {len(refused)} refused with 429, {len(other)} other, "
          f"in {elapsed:.1f} s; admitted TTFT max {max(ttfts, default=0) * 1000:.0f} ms")
    assert not other, [(r.status, r.error, r.transport_error) for r in other[:5]]
    broken = [r for r in admitted if not r.ok or r.usage_tokens != MAX_TOKENS]
    assert not broken, [(r.error, r.usage_tokens) for r in broken[:5]]
    assert refused, "60 clients against a pool that holds 8 must see some 429s"
    for r in refused:
        assert r.error is not None and (r.error["code"], r.error["type"]) == ("rate_limit_exceeded", "rate_limit_error")
        assert int(r.headers["retry-after"]) >= 1
    assert len(admitted) >= SEQS + QUEUE
    # token 0 comes from the prefill pool: admitted requests do not queue for it behind decode work,
    # so every one has it before the first admitted stream ends (a queued one gets a decode slot only then)
    first_end = min(r.t_end for r in admitted)
    late = [r.t_first and round(r.t_first - first_end, 3) for r in admitted
            if r.t_first is None or r.t_first >= first_end]
    assert not late, f"token 0 missing (None) or after the first stream ended (+s): {late}"
