"""Soak test: the mixed locust profile at a steady rate against a local cluster, minute by minute.

    python -m loadtests.soak [--config deploy/local.yaml] [--minutes 10] [--users 4] [--rate 0.2]
                             [--max-tokens N] [--out results/soak.json]         (``make soak``)

Owns: starting ``pdserve serve --config FILE --port <free>`` in a process group of its own
(`loadtests.bench_common.ServerProcess`, stopped and killed at the end whatever happens), running
`loadtests.locustfile.StreamingChatUser` in-process with a steady total arrival rate
(``constant_throughput(rate / users)`` per user; the profile is ``mixed``), bucketing the users'
TTFT / ITL events and errors by minute, sampling the resident memory of every Serve replica process
(``ray::ServeReplica:*`` among the server's descendants) at the end of each minute, and writing
``results/soak.json`` (validated against `SOAK_SCHEMA`).

Pass criteria (exit code 1 otherwise, the JSON is written either way): zero errors, and no replica
whose RSS grew by 5% or more over its value at the end of the first minute (the first minute is
warm-up: caches, allocator pools, the first long prompts); `judge_rss` is that judgement, a pure
function (a run of one minute has nothing to judge it on). After the load the router's ``/metrics``
books (KV blocks used, outbox pending, requests running / waiting) are recorded once they settle.
SIGTERM unwinds like Ctrl-C: the server is stopped on the way out. Importing this module patches
nothing: locust, which monkey-patches the standard library with gevent, is imported when a soak runs.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from loadtests.schemas import SUMMARY

if TYPE_CHECKING:
    from loadtests.bench_common import ServerProcess

PROFILE = "mixed"
RSS_GROWTH_LIMIT = 0.05
_MINUTE_S = 60.0

SOAK_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["benchmark", "created", "machine", "setup", "config", "results"],
    "properties": {
        "benchmark": {"const": "soak"},
        "results": {
            "type": "object",
            "required": ["requests", "errors", "error_samples", "per_minute", "rss_growth_pct", "max_rss_growth_pct",
                         "passed", "idle_books"],
            "properties": {
                "requests": {"type": "integer", "minimum": 0},
                "errors": {"type": "integer", "minimum": 0},
                "error_samples": {"type": "array", "items": {"type": "string"}},
                "per_minute": {"type": "array", "items": {
                    "type": "object",
                    "required": ["minute", "requests", "errors", "ttft_ms", "itl_ms", "ttft_p99_ms", "itl_p99_ms",
                                 "rss_mib"],
                    "properties": {
                        "minute": {"type": "integer", "minimum": 1},
                        "requests": {"type": "integer"}, "errors": {"type": "integer"},
                        "ttft_ms": {"$ref": "#/$defs/summary"}, "itl_ms": {"$ref": "#/$defs/summary"},
                        "ttft_p99_ms": {"type": ["number", "null"]}, "itl_p99_ms": {"type": ["number", "null"]},
                        "rss_mib": {"type": "object", "additionalProperties": {"type": "number"},
                                    "description": "replica (deployment:pid) → RSS in MiB at the end of the minute"},
                    }}},
                "rss_growth_pct": {"type": "object", "additionalProperties": {"type": ["number", "null"]}},
                "max_rss_growth_pct": {"type": ["number", "null"]},
                "passed": {"type": "boolean"},
                "idle_books": {"type": "object"},
            },
        },
    },
    "$defs": {"summary": SUMMARY},
}


@dataclass
class Minute:
    """What happened in one minute of the run (events are bucketed by when they were reported)."""

    requests: int = 0
    errors: int = 0
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    rss_mib: dict[str, float] = field(default_factory=dict)


@dataclass
class Recorder:
    """Listens to locust's request events (the locustfile fires TTFT / ITL / E2E per request)."""

    t0: float
    minutes: int
    buckets: list[Minute] = field(default_factory=list)
    error_samples: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.buckets = [Minute() for _ in range(self.minutes)]

    def on_request(self, request_type: str, name: str, response_time: float, exception: BaseException | None = None,
                   **_: Any) -> None:
        i = int((time.monotonic() - self.t0) // _MINUTE_S)
        if not 0 <= i < self.minutes:
            return  # a stream that ends after the last minute (the users are stopping)
        b = self.buckets[i]
        if request_type == "E2E":
            b.requests += 1
            if exception is not None:
                b.errors += 1
                if len(self.error_samples) < 20:
                    self.error_samples.append(f"{name}: {exception}")
        elif request_type == "POST" and exception is not None and len(self.error_samples) < 20:
            self.error_samples.append(f"POST: {exception}")  # the HTTP failure behind an E2E error
        elif request_type == "TTFT":
            b.ttft.append(response_time)
        elif request_type == "ITL":
            b.itl.append(response_time)


def replica_rss_mib(server: ServerProcess) -> dict[str, float]:
    """``deployment:pid`` → RSS (MiB) of every Serve replica process the server started."""
    out: dict[str, float] = {}
    for p in server.descendants():
        try:
            title = " ".join(p.cmdline())
            if title.startswith("ray::ServeReplica:"):
                deployment = title.split()[0].split(".")[0].split(":")[-1]
                out[f"{deployment}:{p.pid}"] = round(p.memory_info().rss / (1 << 20), 1)
        except psutil.Error:
            continue
    return dict(sorted(out.items()))


@dataclass(frozen=True)
class RssVerdict:
    """The RSS judgement of a run: each replica's growth over minute 1, and those past the limit."""

    growth_pct: dict[str, float | None]  # None: not judged (no sample after minute 1, or none in it)
    max_growth_pct: float | None  # None: no replica could be judged
    grown: tuple[str, ...]  # replicas whose RSS grew by the limit or more

    @property
    def passed(self) -> bool:
        return not self.grown


def judge_rss(rss_by_minute: Sequence[Mapping[str, float]], limit: float = RSS_GROWTH_LIMIT) -> RssVerdict:
    """Judge per-minute RSS samples (replica → MiB at the end of each minute) against ``limit``.

    A replica's growth is its largest RSS after minute 1 relative to its RSS at the end of minute 1,
    in % (rounded to 0.01); it fails at ``100 * limit`` % or more. Replicas first seen after minute 1
    (a restart: a new pid) and every replica of a one-minute run are not judged.
    """
    base = rss_by_minute[0] if rss_by_minute else {}
    growth: dict[str, float | None] = {}
    for key, first in base.items():
        later = [m[key] for m in rss_by_minute[1:] if key in m]
        growth[key] = round(100.0 * (max(later) - first) / first, 2) if later and first else None
    known = [g for g in growth.values() if g is not None]
    grown = tuple(k for k, g in growth.items() if g is not None and g >= 100 * limit)
    return RssVerdict(growth, max(known) if known else None, grown)


def idle_books(base_url: str, timeout_s: float = 60.0) -> dict[str, float]:
    """The router's per-replica books once no request runs (KV blocks used, outbox pending, queues)."""
    import gevent
    import httpx

    names = ("kv_blocks_used", "kv_outbox_pending", "num_requests_running", "num_requests_waiting")
    deadline = time.monotonic() + timeout_s
    books: dict[str, float] = {}
    while time.monotonic() < deadline:
        text = httpx.get(f"{base_url}/metrics", timeout=30).text
        books = {}
        for line in text.splitlines():
            key, _, value = line.rpartition(" ")
            if any(key.startswith(f"pdserve:{n}{{") for n in names):
                books[key] = float(value)
        if books and not any(books.values()):
            break
        gevent.sleep(1.0)
    return books


def run(config: Path, minutes: int, users: int, rate: float, max_tokens: int | None, out: Path,
        seed: int = 0) -> dict[str, Any]:
    """Start the server, soak it, stop it; returns the result document (also written to ``out``)."""
    _import_locust_first()
    import gevent
    from locust import constant_throughput
    from locust.env import Environment

    from cluster.config import ClusterConfig
    from loadtests.bench_common import ServerProcess, log, result_doc, summarize, write_result, yaml_config
    from loadtests.locustfile import StreamingChatUser

    cfg = ClusterConfig.from_yaml(config)

    class SoakUser(StreamingChatUser):
        wait_time = constant_throughput(rate / users)

    with ServerProcess(config, ready_timeout_s=900) as server:
        # the leader of the server's session: every process it starts is in that session
        server_pid = server.proc.pid if server.proc else None
        log(f"soak: {server.base_url} up ({config}); {users} users, {rate:g} req/s, {minutes} min, {PROFILE}")
        env = Environment(user_classes=[SoakUser], host=server.base_url)
        env.parsed_options = argparse.Namespace(profile=PROFILE, model=cfg.name, max_tokens=max_tokens or 0,
                                                seed=seed)
        runner = env.create_local_runner()
        rec = Recorder(time.monotonic(), minutes)
        env.events.request.add_listener(rec.on_request)
        runner.start(users, spawn_rate=users)
        try:
            for i in range(minutes):
                gevent.sleep(max(0.0, rec.t0 + (i + 1) * _MINUTE_S - time.monotonic()))
                rec.buckets[i].rss_mib = replica_rss_mib(server)
                b = rec.buckets[i]
                log(f"soak: minute {i + 1}: {b.requests} requests, {b.errors} errors, TTFT p99 "
                    f"{summarize(b.ttft)['p99']} ms, ITL p99 {summarize(b.itl)['p99']} ms, RSS {b.rss_mib}")
        finally:
            runner.quit()
            env.events.request.remove_listener(rec.on_request)
        books = idle_books(server.base_url)

    rss = judge_rss([b.rss_mib for b in rec.buckets])
    growth, max_growth = rss.growth_pct, rss.max_growth_pct
    errors = sum(b.errors for b in rec.buckets)
    passed = errors == 0 and rss.passed
    results = {
        "requests": sum(b.requests for b in rec.buckets),
        "errors": errors,
        "error_samples": rec.error_samples,
        "per_minute": [{"minute": i + 1, "requests": b.requests, "errors": b.errors,
                        "ttft_ms": summarize(b.ttft), "itl_ms": summarize(b.itl),
                        "ttft_p99_ms": summarize(b.ttft)["p99"], "itl_p99_ms": summarize(b.itl)["p99"],
                        "rss_mib": b.rss_mib} for i, b in enumerate(rec.buckets)],
        "rss_growth_pct": growth,
        "max_rss_growth_pct": max_growth,
        "passed": passed,
        "idle_books": books,
    }
    setup = {"description": f"{PROFILE} profile, {users} locust users at {rate:g} requests/s in total for "
                            f"{minutes} min; RSS of each replica sampled at the end of every minute; pass: 0 "
                            f"errors and RSS growth < {100 * RSS_GROWTH_LIMIT:g}% over minute 1",
             "minutes": minutes, "users": users, "rate_rps": rate, "profile": PROFILE, "max_tokens": max_tokens,
             "server_pid": server_pid}
    doc = result_doc("soak", setup, {"pdserve": yaml_config(config)}, results)
    write_result(out, doc, SOAK_SCHEMA)
    log(f"soak: {results['requests']} requests, {errors} errors, max RSS growth {max_growth}% → {out} "
        f"({'PASS' if passed else 'FAIL'})")
    return doc


def _import_locust_first() -> None:
    """Import locust before anything imports ssl: it monkey-patches the standard library with gevent,
    ssl included, which must happen before httpx (or `loadtests.bench_common`) imports ssl."""
    import locust  # noqa: F401


def main(argv: Sequence[str] | None = None) -> int:
    _import_locust_first()
    from loadtests.bench_common import RESULTS

    p = argparse.ArgumentParser(prog="python -m loadtests.soak", description=__doc__.splitlines()[0])
    p.add_argument("--config", type=Path, default=Path("deploy/local.yaml"))
    p.add_argument("--minutes", type=int, default=10)
    p.add_argument("--users", type=int, default=4)
    p.add_argument("--rate", type=float, default=0.2, help="requests per second, all users together")
    p.add_argument("--max-tokens", type=int, default=None, help="override the profile's output lengths")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS / "soak.json")
    a = p.parse_args(argv)
    if a.minutes < 1 or a.users < 1 or a.rate <= 0:
        p.error("--minutes and --users must be at least 1, --rate positive")
    # SIGTERM (a CI timeout, kill) unwinds like Ctrl-C, so the server is stopped on the way out
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    doc = run(a.config, a.minutes, a.users, a.rate, a.max_tokens, a.out, a.seed)
    return 0 if doc["results"]["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
