"""SIGKILL a replica under load: prefill deaths are invisible to clients; with migration off
(``migration_limit: 0``), decode deaths end streams cleanly with an error event.

One app for the module: 2 journaled prefill replicas (0.3 s before each prefill, so a kill lands on
requests waiting for token 0) and 2 journaled decode replicas (20 ms between streamed events, so
streams are long enough to be cut), real tiny model, KV over gloo. The journals
(`tests.support.journaled_replicas`) say which replica saw which request, so the test knows exactly which
requests were in flight on the victim. What a decode death costs with migration on (the default: the
streams continue elsewhere, exactly) is `tests.reliability.test_migration`.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import psutil
import pytest

from cluster.app import compose_app
from cluster.config import ClusterConfig
from tests.support.journaled_replicas import journaled_decode, journaled_prefill, read_journals
from tests.support.serve_harness import (
    StreamResult,
    cluster_args,
    completion_body,
    deploy,
    replica_processes,
    running_replicas,
    stream_request,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(240)]

APP = "kills"
TOKEN_TIMEOUT_S = 10.0
HOLD_SEED, HOLD_S = 4242, 3.0  # requests with this seed wait 3 s at the decode replica before it pulls


@dataclass
class Journals:
    dir: str
    url: str


@pytest.fixture(scope="module")
def app(serve_base: str, tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Journals]:
    log_dir = str(tmp_path_factory.mktemp("kill-journals"))
    args = cluster_args(tiny_model, prefill={"num_replicas": 2}, decode={"num_replicas": 2},
                        kv={"timeout_s": 10}, limits={"token_timeout_s": TOKEN_TIMEOUT_S, "prefill_timeout_s": 30,
                                                     "migration_limit": 0})
    cfg = ClusterConfig.from_args(args)
    application = compose_app(cfg, prefill_cls=journaled_prefill(log_dir, 0.3),
                              decode_cls=journaled_decode(log_dir, 0.02, HOLD_SEED, HOLD_S))
    with deploy(application, APP, serve_base) as url:
        yield Journals(log_dir, url)


@dataclass
class Load:
    """Closed-loop clients sending streamed completions until told to stop."""

    url: str
    clients: int
    max_tokens: tuple[int, ...] = (8, 12, 16)
    results: list[StreamResult] = field(default_factory=list)
    first_token: set[str] = field(default_factory=set)  # ids that got token 0 (live, as it arrives)
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def run(self) -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            await asyncio.gather(*(self._client(client, i) for i in range(self.clients)))

    async def _client(self, client: httpx.AsyncClient, i: int) -> None:
        n = 0
        while not self.stop.is_set():
            k = self.max_tokens[(i + n) % len(self.max_tokens)]
            body = completion_body(f"client {i} request {n}: a story about the sea", k)
            res = await stream_request(client, f"{self.url}/v1/completions", body, timeout_s=90,
                                       on_first=self.first_token.add)
            res.expected_tokens = k
            self.results.append(res)
            n += 1


async def _until(predicate: object, timeout_s: float, what: str, period_s: float = 0.01) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        await asyncio.sleep(period_s)


def test_prefill_replica_killed_under_load(app: Journals) -> None:
    """Kill a prefill replica with requests waiting for token 0: all are retried, nobody sees an error."""
    pids = set(read_journals(app.dir, "prefill"))
    assert len(pids) == 2 and replica_processes(APP, "prefill") == pids, pids  # journals name the live replicas

    async def scenario() -> tuple[Load, int, float]:
        load = Load(app.url, clients=6)
        runner = asyncio.ensure_future(load.run())
        try:
            await asyncio.sleep(2.0)  # steady state: both replicas busy

            def victim_in_flight() -> int | None:
                for pid, ids in read_journals(app.dir, "prefill").items():
                    if pid in pids and len(set(ids) - load.first_token) >= 2:
                        return pid
                return None

            await _until(lambda: victim_in_flight() is not None, 20, "a replica with 2 prefills in flight")
            victim = victim_in_flight()
            assert victim is not None
            os.kill(victim, signal.SIGKILL)
            t_kill = time.monotonic()

            def rejoined() -> bool:
                fresh = {p: ids for p, ids in read_journals(app.dir, "prefill").items() if p not in pids}
                return running_replicas(APP, "prefill") == 2 and any(len(ids) >= 3 for ids in fresh.values())

            await _until(rejoined, 120, "the killed prefill replica to be replaced and serve", period_s=0.5)
            assert victim not in replica_processes(APP, "prefill")
            return load, victim, time.monotonic() - t_kill
        finally:
            load.stop.set()
            await asyncio.wait_for(runner, 120)

    load, victim, rejoin_s = asyncio.run(scenario())
    journals = read_journals(app.dir, "prefill")
    elsewhere = {rid for pid, ids in journals.items() if pid != victim for rid in ids}
    retried = set(journals[victim]) & elsewhere
    bad = [r for r in load.results if not r.ok or r.usage_tokens != r.expected_tokens]
    fresh = [p for p in journals if p not in pids]
    print(f"prefill kill: {len(load.results)} requests, {len(retried)} retried on another replica, "
          f"replacement {fresh} serving {rejoin_s:.1f} s after the kill, {len(bad)} bad")
    assert not bad, [(r.status, r.error, r.transport_error, r.usage_tokens, r.expected_tokens) for r in bad[:5]]
    assert len(retried) >= 2, "the kill should have caught at least two prefills in flight"
    by_id = {r.request_id: r for r in load.results}
    assert all(by_id[rid].ok for rid in retried)  # each retried request was seen to complete by its client


def test_decode_replica_killed_under_load(app: Journals) -> None:
    """Kill a decode replica mid-stream, migration off: its streams end with an error event in time
    (one that says the limit was reached), others finish."""
    pids = set(read_journals(app.dir, "decode"))
    assert len(pids) == 2, pids
    max_tokens = 300  # at 20 ms per event: a stream lasts ≥ 6 s

    async def scenario() -> tuple[list[StreamResult], list[StreamResult], int, float, set[str]]:
        async with httpx.AsyncClient(timeout=60) as client:
            first: set[str] = set()
            finished: set[str] = set()

            async def one(i: int) -> StreamResult:
                res = await stream_request(
                    client, f"{app.url}/v1/completions", completion_body(f"long stream {i} about rivers", max_tokens),
                    timeout_s=90, on_first=first.add)
                if res.request_id:
                    finished.add(res.request_id)
                return res

            streams = [asyncio.ensure_future(one(i)) for i in range(8)]
            try:
                def live_on(pid: int) -> set[str]:  # streams decoding on that replica right now
                    return (set(read_journals(app.dir, "decode").get(pid, ())) & first) - finished

                def both_busy() -> bool:
                    # Every stream has reached its decode replica (token 0 comes from prefill, so a
                    # stream can be past it while its decode call is still on the way: killed then,
                    # it would be cut without being in the victim's journal), and the router spread
                    # the burst, so each replica holds some.
                    journaled = {rid for ids in read_journals(app.dir, "decode").values() for rid in ids}
                    return (len(first) == 8 and first <= journaled | finished
                            and all(live_on(p) for p in pids))

                try:
                    await _until(both_busy, 60, "all 8 streams on a decode replica, each replica streaming some")
                except AssertionError as e:  # say where the burst went, so a miss names its cause
                    spread = {p: len(live_on(p)) for p in pids}
                    raise AssertionError(f"{e}: live per replica {spread}, {len(first)} with token 0, "
                                         f"{len(finished)} finished") from None
                victim = max(sorted(pids), key=lambda p: len(live_on(p)))
                cut_ids = live_on(victim)
                os.kill(victim, signal.SIGKILL)
                t_kill = time.monotonic()
                done = await asyncio.wait_for(asyncio.gather(*streams), 60)
            finally:
                for s in streams:
                    s.cancel()
            # new requests while the victim is dead or restarting: all served by the live replica(s)
            after = await asyncio.gather(*(stream_request(
                client, f"{app.url}/v1/completions", completion_body(f"after the kill {i}", 12), timeout_s=60)
                for i in range(6)))
        return list(done), list(after), victim, t_kill, cut_ids

    results, after, victim, t_kill, cut_ids = asyncio.run(scenario())
    journals = read_journals(app.dir, "decode")
    on_victim = set(journals[victim])
    cut = [r for r in results if r.request_id in cut_ids]
    kept = [r for r in results if r.request_id not in on_victim]
    end_s = max((r.t_end - t_kill for r in cut), default=0.0)
    print(f"decode kill: {len(cut)} streams cut (all ended {end_s:.2f} s after the kill, limit "
          f"{TOKEN_TIMEOUT_S:g} s), {len(kept)} untouched, {len(after)} new requests served")
    assert cut and kept, (len(cut), len(kept))
    for r in cut:
        assert r.status == 200 and r.error is not None and r.done, (r.error, r.done, r.transport_error)
        assert set(r.error) == {"message", "type", "param", "code"} and "migration_limit is 0" in r.error["message"]
        assert r.usage_tokens is None and r.finish_reason is None
    assert end_s < TOKEN_TIMEOUT_S
    for r in kept:
        assert r.ok and r.usage_tokens == max_tokens, (r.error, r.usage_tokens)
    assert all(r.ok and r.usage_tokens == 12 for r in after), [(r.error, r.usage_tokens) for r in after]
    new_ids = {r.request_id for r in after}
    assert not new_ids & on_victim, "a new request reached the dead decode replica"


def test_prefill_killed_between_token_0_and_the_pull(app: Journals) -> None:
    """Requests whose token 0 is out but whose KV still waits in the victim's outbox: rebuilt, no error.

    The decode replica holds these requests 3 s before pulling (as a full batch would); the prefill
    replica that holds their KV is killed meanwhile, so every pull fails. The router prefills each
    prompt again on a live replica and resubmits, keeping the token 0 the client already has.
    """
    live = {pid for pid in read_journals(app.dir, "prefill") if psutil.pid_exists(pid)}

    async def scenario() -> tuple[list[StreamResult], int]:
        async with httpx.AsyncClient(timeout=60) as client:
            first: set[str] = set()
            streams = [asyncio.ensure_future(stream_request(
                client, f"{app.url}/v1/completions",
                completion_body(f"held request {i} about mountains", 12, seed=HOLD_SEED), timeout_s=90,
                on_first=first.add)) for i in range(6)]
            try:
                await _until(lambda: len(first) == 6, 30, "token 0 of all six requests")
                journals = read_journals(app.dir, "prefill")
                victim = max((p for p in live if p in journals), key=lambda p: len(set(journals[p]) & first))
                assert set(journals[victim]) & first
                os.kill(victim, signal.SIGKILL)  # within the 3 s hold: their KV dies with it
                return list(await asyncio.wait_for(asyncio.gather(*streams), 60)), victim
            finally:
                for s in streams:
                    s.cancel()

    results, victim = asyncio.run(scenario())
    journals = read_journals(app.dir, "prefill")
    held = {r.request_id for r in results} & set(journals[victim])
    rebuilt = {rid for pid, ids in journals.items() if pid != victim for rid in ids} & held
    print(f"prefill kill after token 0: {len(held)} requests had their KV on the victim, {len(rebuilt)} "
          f"prefilled again elsewhere, {sum(r.ok for r in results)}/{len(results)} completed")
    assert held and rebuilt == held
    assert all(r.ok and r.usage_tokens == 12 for r in results), [(r.error, r.usage_tokens) for r in results]
