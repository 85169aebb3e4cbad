"""Clients that hang up: mid-stream and before token 0. Afterwards, at idle, every book is whole.

300 short streamed completions (8-24 tokens) against a real tiny-model app (1 prefill + 1 decode,
KV over gloo): a seeded 10% hang up after a random number of chunks, 5% hang up on a raw socket
before any response byte (while the request is being prefilled or queued), the rest must finish
with exactly their token count. Then the router's ``/metrics`` must show, for every replica, no KV
block in use, nothing pending in a prefill outbox and no request running or waiting; the replicas'
own books (``stats()``, which runs the block pool's integrity check) must agree.

A client that hangs up between token 0 and the decode call leaves a handle no decode replica took:
the router releases it through a decode replica, so its blocks do not wait for the lease. One
window is left to the lease (short here, 4 s, so the test sees it end): a client that hangs up
just as its prefill finishes, when Serve drops the answer that carried the handle; so leases may
expire only for requests dropped before token 0, never for those dropped mid-stream.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from ray import serve

from cluster.app import compose_app
from cluster.config import ClusterConfig
from tests.support.serve_harness import (
    StreamResult,
    cluster_args,
    completion_body,
    deploy,
    drop_before_first_token,
    gauge,
    parse_metrics,
    stream_request,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(240)]

APP = "disconnects"
LEASE_S = 4.0
N_REQUESTS = 300
CONCURRENCY = 16


@pytest.fixture(scope="module")
def url(serve_base: str, tiny_model: str) -> Iterator[str]:
    args = cluster_args(tiny_model, kv={"lease_s": LEASE_S}, limits={"token_timeout_s": 20})
    with deploy(compose_app(ClusterConfig.from_args(args)), APP, serve_base) as u:
        yield u


def idle_books(url: str) -> dict[str, Any]:
    """The per-replica gauges that must be zero at idle, as the router's /metrics shows them."""
    samples = parse_metrics(httpx.get(f"{url}/metrics", timeout=30).text)
    return {name: gauge(samples, f"pdserve:{name}") for name in
            ("kv_blocks_used", "kv_outbox_pending", "num_requests_running", "num_requests_waiting")}


def test_disconnects_leave_nothing_behind(url: str) -> None:
    rng = random.Random(1234)
    plan: list[tuple[str, int, int]] = []  # (kind, max_tokens, chunks to read before hanging up)
    for _ in range(N_REQUESTS):
        k = rng.randint(8, 24)
        u = rng.random()
        kind = "mid" if u < 0.10 else "early" if u < 0.15 else "full"
        plan.append((kind, k, rng.randint(1, k - 1)))

    async def run() -> list[StreamResult | None]:
        sem = asyncio.Semaphore(CONCURRENCY)
        endpoint = f"{url}/v1/completions"

        async def one(i: int, client: httpx.AsyncClient) -> StreamResult | None:
            kind, k, after = plan[i]
            body = completion_body(f"request {i}: tell me about the weather in spring", k)
            async with sem:
                if kind == "early":
                    await drop_before_first_token(endpoint, body, after_s=rng.uniform(0.0, 0.1))
                    return None
                res = await stream_request(client, endpoint, body, drop_after=after if kind == "mid" else None,
                                           timeout_s=120)
                res.expected_tokens = k
                return res

        limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:
            return await asyncio.gather(*(one(i, client) for i in range(N_REQUESTS)))

    t0 = time.monotonic()
    results = asyncio.run(run())
    load_s = time.monotonic() - t0
    full = [r for (kind, _, _), r in zip(plan, results, strict=True) if kind == "full"]
    mid = [r for (kind, _, _), r in zip(plan, results, strict=True) if kind == "mid"]
    n_early = sum(kind == "early" for kind, _, _ in plan)
    bad = [r for r in full if r is None or not r.ok or r.usage_tokens != r.expected_tokens]
    assert not bad, [(r.status, r.error, r.transport_error, r.usage_tokens) for r in bad[:5] if r]
    assert all(r is not None and r.dropped and r.status == 200 for r in mid)

    # at idle: every book whole, seen through /metrics (gauges from the replicas' load reports)
    deadline = time.monotonic() + LEASE_S + 30
    while True:
        books = idle_books(url)
        nonzero = {name: v for name, g in books.items() for v in g.values() if v}
        if all(books.values()) and not nonzero:
            break
        assert time.monotonic() < deadline, books
        time.sleep(0.5)
    assert len(books["kv_blocks_used"]) == 2 and len(books["kv_outbox_pending"]) == 1, books
    idle_s = time.monotonic() - t0 - load_s

    prefill = serve.get_deployment_handle("prefill", app_name=APP).stats.remote().result(timeout_s=30)
    decode = serve.get_deployment_handle("decode", app_name=APP).stats.remote().result(timeout_s=30)
    outbox = prefill["source"]["outbox"]
    assert (prefill["kv_blocks_used"], prefill["outbox_pending"], prefill["outbox_blocks_held"]) == (0, 0, 0)
    assert (decode["kv_blocks_used"], decode["streams"], decode["idle"]) == (0, 0, True)
    assert outbox["put"] == outbox["done"] + outbox["released"] + outbox["expired"]
    assert outbox["expired"] <= n_early, "a handle of a request that got its token 0 was left to its lease"
    ttfts = sorted(r.ttft for r in full if r is not None and r.ttft is not None)
    print(f"disconnects: {len(full)} full (TTFT p50 {ttfts[len(ttfts) // 2] * 1000:.0f} ms), {len(mid)} dropped "
          f"mid-stream, {n_early} dropped before token 0 (a raw socket closed 0-100 ms after sending), all in "
          f"{load_s:.1f} s; idle books whole {idle_s:.1f} s later; outbox put={outbox['put']} "
          f"pulled={outbox['done']} released={outbox['released']} lease-expired={outbox['expired']}")


def test_hanging_up_right_after_token_0_leaves_no_lease(url: str) -> None:
    """80 clients each read token 0 and hang up: the decode call is cancelled, often before any decode
    replica took the request, and every handle is pulled or released, none left to its lease."""
    prefill = serve.get_deployment_handle("prefill", app_name=APP)
    before = prefill.stats.remote().result(timeout_s=30)["source"]["outbox"]

    async def run() -> list[StreamResult]:
        sem = asyncio.Semaphore(8)
        async with httpx.AsyncClient(timeout=60) as client:
            async def one(i: int) -> StreamResult:
                async with sem:
                    return await stream_request(client, f"{url}/v1/completions",
                                                completion_body(f"hang up {i} after the first word", 16),
                                                drop_after=1)
            return list(await asyncio.gather(*(one(i) for i in range(80))))

    results = asyncio.run(run())
    assert all(r.status == 200 and r.dropped for r in results)
    time.sleep(LEASE_S + 2)  # long enough for any forgotten handle's lease to run out
    after = prefill.stats.remote().result(timeout_s=30)
    delta = {k: after["source"]["outbox"][k] - before[k] for k in ("put", "done", "released", "expired")}
    print(f"hang up after token 0: {delta}")
    assert delta["expired"] == 0 and delta["put"] == delta["done"] + delta["released"] == 80, delta
    assert after["outbox_pending"] == 0
