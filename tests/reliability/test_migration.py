"""A decode replica dies or hangs mid-stream: its streams move to a live one and continue exactly.

Two apps of the real tiny model, two decode replicas each (journaled: the journals say which
replica holds which request, `tests.support.journaled_replicas`): disaggregated (two prefill
replicas, KV over gloo) and colocated (the live replica prefills each continuation). The oracle is an
uninterrupted run of the same requests on the same app: greedy and seeded, completions and chat,
one of ``n = 2`` choices, one under a JSON schema. Then the same requests again, and the decode
replica streaming the most of them is SIGKILLed (or SIGSTOPped past the token timeout, then woken):
every stream completes with the uninterrupted text of every choice and its token count, with no
error event (a greedy stream, which carries its top two log-probs, may part from it only where its
two likeliest tokens were a near-tie, which the batch a step ran in decides: `near_tie`); the
killed replica is replaced and serves new requests; at idle every replica's books
(blocks, outbox, running and waiting requests) are whole. ``migration_limit`` reached is
`tests.reliability.test_kills` (limit 0) and `tests.router.test_router_migration`. The request of
``n = 2`` makes two continuations at once when its replica dies: they reach a replica only because
each call is a Serve request of its own (`router.backends.own_call`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from cluster.app import compose_app
from cluster.config import ClusterConfig
from tests.support.journaled_replicas import journaled_decode, journaled_prefill, read_journals
from tests.support.serve_harness import (
    StreamResult,
    cluster_args,
    completion_body,
    deploy,
    gauge,
    parse_metrics,
    replica_processes,
    running_replicas,
    stream_request,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(420)]

TOKEN_TIMEOUT_S = 8.0
MAX_TOKENS = 300  # seconds of streaming on the tiny model, so that a signal lands mid-stream
# every stream fits one decode replica's blocks at once: a continuation never queues for blocks behind
# the streams already there (it would wait past the token timeout and move again)
WORDS = {"type": "object", "properties": {"words": {"type": "array", "maxItems": 60,
                                                    "items": {"enum": ["sea", "sky", "stone", "light blue"]}}},
         "required": ["words"], "additionalProperties": False}


@dataclass
class App:
    name: str
    url: str
    journals: str


def _app(serve_base: str, tiny_model: str, work: str, name: str, mode: str) -> Iterator[App]:
    args = cluster_args(tiny_model, mode=mode, prefill={"num_replicas": 2},
                        decode={"num_replicas": 2, "num_blocks": 1024, "policy": "least_outstanding_tokens"},
                        kv={"timeout_s": 10},
                        limits={"token_timeout_s": TOKEN_TIMEOUT_S, "prefill_timeout_s": 30})
    decode = journaled_decode(work, 0.05)  # at most 20 events a second a stream: the replica stays responsive
    application = compose_app(ClusterConfig.from_args(args), decode_cls=decode,
                              **({"prefill_cls": journaled_prefill(work)} if mode == "disaggregated" else {}))
    with deploy(application, name, serve_base) as url:
        app = App(name, url, work)
        warm_up(app)
        yield app


def warm_up(app: App) -> None:
    """Long prompts of several lengths on every replica: a continuation's prefill (on a prefill
    replica, or colocated on the decode replica) covers the prompt and the tokens sent, longer than
    any prompt here, and a first forward of a new length may compile kernels for longer than the
    token timeout (the same stall an ordinary long prompt would meet)."""
    bodies = [("/v1/completions", completion_body("warm " * n, 2)) for n in (60, 120, 180, 240, 300, 360)] * 2
    results = asyncio.run(run_all(app, bodies))
    assert all(r.ok for r in results), [(r.status, r.error) for r in results if not r.ok]


@pytest.fixture(scope="module")
def disagg(serve_base: str, tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[App]:
    yield from _app(serve_base, tiny_model, str(tmp_path_factory.mktemp("mig-pd")), "migration", "disaggregated")


@pytest.fixture(scope="module")
def colocated(serve_base: str, tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[App]:
    yield from _app(serve_base, tiny_model, str(tmp_path_factory.mktemp("mig-colo")), "migration-colo", "colocated")


def requests(tag: str, count: int) -> list[tuple[str, dict[str, Any]]]:
    """(path, body) of ``count`` streamed requests: greedy and seeded completions, greedy and seeded
    chats, one of two seeded choices, one under a JSON schema."""
    out: list[tuple[str, dict[str, Any]]] = []
    for i in range(count):
        prompt = f"{tag} {i}: a long story about the sea"
        seeded = {"temperature": 0.8, "seed": 100 + i} if i % 2 else {}
        if i % 4 < 2:
            greedy = {} if seeded else {"logprobs": 2}
            out.append(("/v1/completions", completion_body(prompt, MAX_TOKENS, **seeded, **greedy)))
        else:
            greedy = {} if seeded else {"logprobs": True, "top_logprobs": 2}
            body = {k: v for k, v in completion_body("", MAX_TOKENS, **seeded, **greedy).items() if k != "prompt"}
            out.append(("/v1/chat/completions", {**body, "messages": [{"role": "user", "content": prompt}]}))
    out[-1] = ("/v1/completions", completion_body(f"{tag}: two tellings", MAX_TOKENS, n=2, temperature=0.9, seed=7))
    out[-2] = ("/v1/chat/completions", {**out[-2][1], "response_format": {
        "type": "json_schema", "json_schema": {"name": "words", "schema": WORDS}}})
    return out


async def _until(predicate: Callable[[], bool], timeout_s: float, what: str, period_s: float = 0.02) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        await asyncio.sleep(period_s)


def outcome(r: StreamResult) -> tuple[dict[int, str], int | None]:
    return r.choice_texts, r.usage_tokens


async def run_all(app: App, reqs: list[tuple[str, dict[str, Any]]], on_first: Callable[[str], None] | None = None,
                  ended: set[str] | None = None) -> list[StreamResult]:
    """Every request at once; ``on_first(id)`` at each one's token 0, its id into ``ended`` at its end."""
    async def one(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> StreamResult:
        res = await stream_request(client, app.url + path, body, timeout_s=180, on_first=on_first)
        if ended is not None and res.request_id:
            ended.add(res.request_id)
        return res

    async with httpx.AsyncClient(timeout=120) as client:
        return list(await asyncio.gather(*(one(client, path, body) for path, body in reqs)))


def interrupted(app: App, reqs: list[tuple[str, dict[str, Any]]], sig: signal.Signals
                ) -> tuple[list[StreamResult], int, float, set[str]]:
    """``reqs`` at once; once each decode replica streams some, ``sig`` to the one streaming the most
    (SIGSTOP: SIGCONT once every stream has ended). Returns the results, the victim, the time of the
    signal and the ids of the streams it held."""
    pids = replica_processes(app.name, "decode")
    assert len(pids) == 2, pids
    first: set[str] = set()

    async def scenario() -> tuple[list[StreamResult], int, float, set[str]]:
        ended: set[str] = set()
        runner = asyncio.ensure_future(run_all(app, reqs, first.add, ended))

        def live_on(pid: int) -> set[str]:
            return (set(read_journals(app.journals, "decode").get(pid, ())) & first) - ended

        def both_busy() -> bool:
            journaled = {rid for ids in read_journals(app.journals, "decode").values() for rid in ids}
            return len(first) == len(reqs) and first <= journaled and all(live_on(p) for p in pids)

        try:
            await _until(both_busy, 90, "every stream on a decode replica, each replica streaming some")
            await asyncio.sleep(0.2)  # mid-stream: tokens out, most still to come
            victim = max(sorted(pids), key=lambda p: len(live_on(p)))
            held = live_on(victim)
            os.kill(victim, sig)
            t_sig = time.monotonic()
            results = await asyncio.wait_for(runner, 180)
        finally:
            runner.cancel()
            if sig == signal.SIGSTOP:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(victim, signal.SIGCONT)
        return results, victim, t_sig, held

    return asyncio.run(scenario())


def check_exact(want: list[StreamResult], got: list[StreamResult], held: set[str], t_sig: float, what: str) -> None:
    bad = [(r.status, r.error, r.transport_error) for r in want + got if not r.ok]
    assert not bad, bad[:5]
    moved = [r for r in got if r.request_id in held]
    assert moved, "the victim held no stream"
    pairs = [(i, w, r) for i, (w, r) in enumerate(zip(want, got, strict=True)) if outcome(r) != outcome(w)]
    ties = [(i, tie) for i, w, r in pairs if (tie := near_tie(w, r)) is not None]
    differ = [(i, r.request_id in held, _first_difference(outcome(w), outcome(r)))
              for i, w, r in pairs if i not in dict(ties)]
    assert not differ, f"(request, moved, (choice, first differing character, tokens wanted, got)): {differ}"
    if ties:
        print(f"{what}: greedy streams parted at a near-tie of their two likeliest tokens (request, step): {ties}")
    gaps = sorted(max((b - a for a, b in zip(r.chunk_times, r.chunk_times[1:], strict=False)
                       if b >= t_sig), default=0.0) for r in moved)
    print(f"{what}: {len(got)} streams whole, {len(moved)} moved off the victim; client-side gap at the "
          f"signal p50 {statistics.median(gaps) * 1000:.0f} ms, max {gaps[-1] * 1000:.0f} ms")


#: two log-probs this close are a tie to greedy decoding: which one wins may depend on the batch a
#: step ran in (the order of a matmul's sums), which no serving system holds fixed across runs
TIE = 1e-3


def near_tie(want: StreamResult, got: StreamResult) -> tuple[int, int] | None:
    """(choice, step) where a greedy stream first took a different token, if both runs' two likeliest
    tokens there were a near-tie (`TIE`) and each took one of them; None for any other difference."""
    for c in sorted(set(want.choice_texts) | set(got.choice_texts)):
        a, b = want.choice_tokens.get(c, []), got.choice_tokens.get(c, [])
        k = next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x[0] != y[0]), None)
        if k is None:
            if want.choice_texts.get(c) != got.choice_texts.get(c):
                return None  # same tokens as far as both go, but not the same text or length
            continue
        tops = [dict(a[k][1][:2]), dict(b[k][1][:2])]
        if any(len(t) < 2 for t in tops) or a[k][0] not in tops[1] or b[k][0] not in tops[0]:
            return None
        if all(abs(lp1 - lp2) > TIE for lp1, lp2 in (t.values() for t in tops)):
            return None
        return c, k
    return None


def _first_difference(want: tuple[dict[int, str], int | None], got: tuple[dict[int, str], int | None]
                      ) -> tuple[int, int, int | None, int | None]:
    texts_w, texts_g = want[0], got[0]
    for c in sorted(set(texts_w) | set(texts_g)):
        a, b = texts_w.get(c, ""), texts_g.get(c, "")
        if a != b:
            at = next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            return c, at, want[1], got[1]
    return -1, -1, want[1], got[1]


def metrics(app: App) -> dict[str, float]:
    return parse_metrics(httpx.get(f"{app.url}/metrics", timeout=30).text)


def books_whole(app: App, timeout_s: float = 60.0) -> None:
    """Every replica's blocks, outbox and requests at zero, as the router's /metrics shows them."""
    deadline = time.monotonic() + timeout_s
    while True:
        samples = metrics(app)
        books = {name: gauge(samples, f"pdserve:{name}") for name in
                 ("kv_blocks_used", "kv_outbox_pending", "num_requests_running", "num_requests_waiting")}
        if books["kv_blocks_used"] and not any(v for g in books.values() for v in g.values()):
            return
        assert time.monotonic() < deadline, books
        time.sleep(0.5)


def replaced_and_serving(app: App, victim: int) -> None:
    """The killed decode replica is replaced, and new requests are served (some by the newcomer)."""
    deadline = time.monotonic() + 120
    while running_replicas(app.name, "decode") < 2 or len(replica_processes(app.name, "decode")) < 2:
        assert time.monotonic() < deadline, "the killed decode replica was not replaced"
        time.sleep(0.5)
    fresh = replica_processes(app.name, "decode") - {victim}
    after = asyncio.run(run_all(app, [("/v1/completions", completion_body(f"after {i}", 8)) for i in range(8)]))
    assert all(r.ok and r.usage_tokens == 8 for r in after), [(r.error, r.usage_tokens) for r in after]
    journals = read_journals(app.journals, "decode")
    served = {r.request_id for r in after} & {rid for pid in fresh for rid in journals.get(pid, ())}
    assert victim not in replica_processes(app.name, "decode") and served


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_killed_decode_replica_streams_continue_exactly(mode: str, request: pytest.FixtureRequest) -> None:
    app: App = request.getfixturevalue("disagg" if mode == "disaggregated" else "colocated")
    reqs = requests(f"kill-{mode}", 16)
    want = asyncio.run(run_all(app, reqs))
    books_whole(app)  # idle, and the replicas' load reports say so: the next burst spreads over both
    before = metrics(app)
    got, victim, t_kill, held = interrupted(app, reqs, signal.SIGKILL)
    check_exact(want, got, held, t_kill, f"{mode} SIGKILL")
    after = metrics(app)
    moved = after['pdserve:router_migrations_total{reason="replica_died"}'] - before.get(
        'pdserve:router_migrations_total{reason="replica_died"}', 0.0)
    recomputed = after["pdserve:router_migration_recomputed_tokens_total"] - before.get(
        "pdserve:router_migration_recomputed_tokens_total", 0.0)
    print(f"{mode}: {moved:.0f} streams migrated, {recomputed / max(moved, 1):.0f} tokens recomputed per migration")
    assert moved >= 1
    replaced_and_serving(app, victim)
    books_whole(app)


def test_hung_decode_replica_is_left_behind_and_nothing_arrives_twice(disagg: App) -> None:
    reqs = requests("hang", 8)
    want = asyncio.run(run_all(disagg, reqs))
    books_whole(disagg)
    got, victim, t_stop, held = interrupted(disagg, reqs, signal.SIGSTOP)
    check_exact(want, got, held, t_stop, "SIGSTOP past the token timeout")
    samples = metrics(disagg)
    assert samples['pdserve:router_migrations_total{reason="token_timeout"}'] >= 1
    continued = {rid.split(":m")[0] for pid, ids in read_journals(disagg.journals, "decode").items() if pid != victim
                 for rid in ids if ":m" in rid}
    # A stream the victim held either continued elsewhere, or had every event out of the victim before
    # the stop (its last ones in flight to the client when it was named): then it ended without the
    # token timeout's wait.
    by_id = {r.request_id: r for r in got}
    stalled = {rid for rid in held - continued
               if max((b - a for a, b in zip(by_id[rid].chunk_times, by_id[rid].chunk_times[1:], strict=False)
                       if b >= t_stop), default=0.0) >= TOKEN_TIMEOUT_S / 2}
    assert held & continued and not stalled, ("each stream the hung replica held and stalled continued on "
                                              f"another replica: held {held}, continued {continued}")
    books_whole(disagg)  # the woken replica freed what its cancelled streams held
