"""What the serving benchmarks share: a pdserve server subprocess, a timed streaming client, stats, output.

Owns:
- `ServerProcess`: ``pdserve serve --config FILE --port N`` in its own process group, ready when
  ``/ready`` answers 200; stopped with SIGTERM (the CLI shuts Serve and Ray down), and if that
  does not end it in time, SIGKILL to its process group and to every process it started.
- `stream_chat` / `fill_stream`: one streamed chat request over httpx that records the client-side
  arrival time of every token chunk (`RequestRecord`); `warm_up`; `wait_idle` (the replicas' load
  gauges at zero).
- `summarize` (n / mean / p50 / p90 / p99 / max of a list of milliseconds), `replica_affinity`
  (the CPU affinity each replica's threads actually run with), `server_metrics` (means of the
  router's latency histograms from ``/metrics``), `result_doc` + `write_result` (the common header
  of every result JSON, validated against its schema before it is written).

Times are `time.perf_counter` seconds in the benchmark process; only differences are reported.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import psutil
import yaml

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "results"
LOG_DIR = Path(os.environ.get("TMPDIR", "/tmp")) / "pdserve-bench"
MODEL = "smollm2-135m-instruct"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """``pdserve serve`` for one config, as a context manager (see the module docstring)."""

    def __init__(self, config: str | Path, port: int | None = None, ready_timeout_s: float = 300.0,
                 stop_timeout_s: float = 60.0, log_path: Path | None = None) -> None:
        self.config = Path(config)
        self.port = port or free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.ready_timeout_s = ready_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.log_path = log_path or LOG_DIR / f"{self.config.stem}-{self.port}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> ServerProcess:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "RAY_AUTH_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false"}
        exe = Path(sys.executable).with_name("pdserve")
        cli = [str(exe)] if exe.exists() else [sys.executable, "-m", "cluster.cli"]
        cmd = [*cli, "serve", "--config", str(self.config), "--port", str(self.port)]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"pdserve serve exited with {self.proc.returncode}; log: {self.log_path}\n"
                                   + self.log_tail())
            try:
                if httpx.get(f"{self.base_url}/ready", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        raise TimeoutError(f"{self.base_url}/ready not 200 within {self.ready_timeout_s:g} s; log: {self.log_path}\n"
                           + self.log_tail())

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        try:
            started = psutil.Process(proc.pid).children(recursive=True)
        except psutil.Error:
            started = []
        proc.send_signal(signal.SIGTERM)  # the CLI shuts Serve and Ray down itself
        try:
            proc.wait(timeout=self.stop_timeout_s)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=30)
        for child in started:  # Ray daemons it started in sessions of their own, if any outlived it
            try:
                if child.is_running():
                    child.kill()
            except psutil.Error:
                pass

    def descendants(self) -> list[psutil.Process]:
        if self.proc is None:
            return []
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            return []


def replica_affinity(server: ServerProcess) -> dict[str, list[list[int]]]:
    """For each Serve replica process of ``server``: the distinct CPU sets its threads may run on."""
    out: dict[str, list[list[int]]] = {}
    for p in server.descendants():
        try:
            title = " ".join(p.cmdline())
        except psutil.Error:
            continue
        m = re.search(r"ServeReplica:[^:\s]+:(\w+)", title)
        if not m:
            continue
        sets: set[tuple[int, ...]] = set()
        for t in p.threads():
            try:
                sets.add(tuple(sorted(os.sched_getaffinity(t.id))))
            except OSError:
                continue
        out[m.group(1)] = sorted(list(s) for s in sets)
    return out


@dataclass
class RequestRecord:
    """One streamed request as the client saw it (perf_counter seconds)."""

    kind: str  # the workload name: "chat" | "long"
    prompt_tokens: int
    max_tokens: int
    sent: float
    arrivals: list[float] = field(default_factory=list)  # one per token chunk
    end: float | None = None
    usage_tokens: int | None = None
    error: str | None = None
    user: int = -1

    @property
    def ok(self) -> bool:
        return self.error is None and self.end is not None and bool(self.arrivals)

    @property
    def ttft(self) -> float | None:
        return self.arrivals[0] - self.sent if self.arrivals else None

    @property
    def n_tokens(self) -> int:
        return self.usage_tokens if self.usage_tokens is not None else len(self.arrivals)

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.n_tokens < 2 or self.end is None:
            return None
        return (self.arrivals[-1] - self.arrivals[0]) / (self.n_tokens - 1)

    def itls(self) -> list[tuple[float, float]]:
        """(arrival time of the later token, gap) for every pair of successive token chunks."""
        return [(b, b - a) for a, b in itertools.pairwise(self.arrivals)]


def new_record(kind: str, body: Mapping[str, Any], user: int = -1, prompt_tokens: int = 0) -> RequestRecord:
    return RequestRecord(kind=kind, prompt_tokens=prompt_tokens, max_tokens=int(body.get("max_tokens", 0)),
                         sent=time.perf_counter(), user=user)


class StreamFailed(Exception):
    """An event stream that carried an error chunk or ended without ``data: [DONE]``."""


async def sse_chunks(resp: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    """The JSON chunks of an OpenAI event stream up to its ``data: [DONE]``; `StreamFailed` on an
    error chunk or an end without ``[DONE]``."""
    async for line in resp.aiter_lines():
        if not line.startswith("data: "):
            continue
        if line[6:] == "[DONE]":
            return
        chunk = json.loads(line[6:])
        if "error" in chunk:
            raise StreamFailed(f"stream error: {chunk['error']}")
        yield chunk
    raise StreamFailed("the stream ended without [DONE]")


async def stream_request(client: httpx.AsyncClient, path: str, body: Mapping[str, Any],
                         on_chunk: Callable[[dict[str, Any]], None]) -> str | None:
    """POST a streamed request and hand each chunk to ``on_chunk``; the error in words, or None once
    ``[DONE]`` arrived."""
    try:
        async with client.stream("POST", path, json=body) as resp:
            if resp.status_code != 200:
                return f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
            async for chunk in sse_chunks(resp):
                on_chunk(chunk)
    except StreamFailed as e:
        return str(e)
    except httpx.HTTPError as e:
        return f"{type(e).__name__}: {e}"
    return None


async def fill_stream(client: httpx.AsyncClient, body: Mapping[str, Any], rec: RequestRecord) -> RequestRecord:
    """POST one streamed chat request into ``rec``; server and network errors go in ``rec.error``.

    Cancelling the caller leaves ``rec`` with the tokens that arrived so far (and no ``end``).
    """

    def record(chunk: dict[str, Any]) -> None:
        if chunk.get("choices"):
            rec.arrivals.append(time.perf_counter())
        if chunk.get("usage"):
            rec.usage_tokens = int(chunk["usage"]["completion_tokens"])

    rec.sent = time.perf_counter()
    rec.error = await stream_request(client, "/v1/chat/completions", body, record)
    if rec.error is None:
        rec.end = time.perf_counter()
    return rec


async def stream_chat(client: httpx.AsyncClient, body: Mapping[str, Any], kind: str, user: int = -1,
                      prompt_tokens: int = 0) -> RequestRecord:
    return await fill_stream(client, body, new_record(kind, body, user, prompt_tokens))


async def warm_up(client: httpx.AsyncClient, users: int, long_prompt_tokens: int, seed: int = 12345) -> None:
    """``users`` short chat streams at once and one long prompt: kernels, buffers and KV pairs warm."""
    from loadtests.profiles import Workload, chat_body

    rng = random.Random(seed)
    bodies = [chat_body(MODEL, Workload("chat", 100, 16), rng) for _ in range(users)]
    bodies.append(chat_body(MODEL, Workload("long", long_prompt_tokens, 4), rng))
    recs = await asyncio.gather(*(stream_chat(client, b, "warm-up") for b in bodies))
    bad = [r.error for r in recs if not r.ok]
    if bad:
        raise RuntimeError(f"warm-up failed: {bad[0]}")


def metric_totals(base_url: str, names: Sequence[str]) -> dict[str, float] | None:
    """Each of ``names`` (sample names at ``/metrics``) summed over its label sets; names with no
    sample are left out; None if ``/metrics`` does not answer."""
    try:
        text = httpx.get(f"{base_url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return None
    wanted = set(names)
    totals: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^([\w:]+)(?:\{[^}]*\})? (\S+)$", line)
        if m and m.group(1) in wanted:
            totals[m.group(1)] = totals.get(m.group(1), 0.0) + float(m.group(2))
    return totals


PDSERVE_LOAD_GAUGES = ("pdserve:num_requests_running", "pdserve:num_requests_waiting")


def load_gauges(base_url: str, names: Sequence[str] = PDSERVE_LOAD_GAUGES) -> float:
    """Requests running + waiting on every replica, from ``/metrics`` (0 when idle)."""
    totals = metric_totals(base_url, names)
    return sum(totals.values()) if totals else 0.0


async def wait_idle(base_url: str, timeout_s: float = 30.0, names: Sequence[str] = PDSERVE_LOAD_GAUGES) -> bool:
    """True once the load gauges ``names`` (another server's, e.g. vLLM's) read 0; False at the timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await asyncio.to_thread(load_gauges, base_url, names) == 0:
            return True
        await asyncio.sleep(1.0)
    return False


def summarize(values_ms: Sequence[float]) -> dict[str, float | int | None]:
    """n, mean, p50, p90, p99, max (nearest-rank percentiles); None where there are no values."""
    vals = sorted(values_ms)
    n = len(vals)

    def pct(q: float) -> float | None:
        if not vals:
            return None
        return round(vals[min(n - 1, max(0, int(-(-q * n // 100)) - 1))], 3)

    return {"n": n, "mean": round(sum(vals) / n, 3) if n else None, "p50": pct(50), "p90": pct(90),
            "p99": pct(99), "max": round(vals[-1], 3) if vals else None}


def server_metrics(base_url: str) -> dict[str, dict[str, float]]:
    """Count and mean (s) of each ``pdserve:*_seconds`` histogram the router exposes at ``/metrics``."""
    try:
        text = httpx.get(f"{base_url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^(pdserve:\w+_seconds)_(sum|count)(?:\{[^}]*\})? ([0-9.eE+-]+)$", line)
        if m:
            target = sums if m.group(2) == "sum" else counts
            target[m.group(1)] = target.get(m.group(1), 0.0) + float(m.group(3))
    return {k: {"count": counts.get(k, 0.0), "mean_s": round(sums[k] / counts[k], 6) if counts.get(k) else 0.0}
            for k in sorted(sums)}


def yaml_config(path: str | Path) -> dict[str, Any]:
    """A config file as recorded in a result: its repo-relative path and the parsed YAML."""
    p = Path(path)
    rel = p.resolve().relative_to(REPO) if p.resolve().is_relative_to(REPO) else p
    return {"path": str(rel), "yaml": yaml.safe_load(p.read_text())}


def machine() -> dict[str, Any]:
    from loadtests.machine import machine_info

    info: dict[str, Any] = dict(machine_info())
    info["cpus"] = os.cpu_count()
    info["load_avg_1m_at_start"] = round(os.getloadavg()[0], 2)
    return info


def result_doc(benchmark: str, setup: Mapping[str, Any], config: Mapping[str, Any],
               results: Mapping[str, Any], machine_info: Mapping[str, Any] | None = None) -> dict[str, Any]:
    return {
        "benchmark": benchmark,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": dict(machine_info) if machine_info is not None else machine(),
        "setup": dict(setup),
        "config": dict(config),
        "results": dict(results),
    }


def write_result(path: Path, doc: Mapping[str, Any], schema: Mapping[str, Any]) -> Path:
    """Validate ``doc`` against ``schema`` (raises `jsonschema.ValidationError`), then write it."""
    jsonschema.validate(doc, schema)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)
