"""Apps on a local Serve for the reliability and e2e tests: app configs, streaming clients, metrics, process books.

Owns: `cluster_args` (a small `ClusterConfig` ``args:`` mapping for the tiny model), `local_serve` (a
Ray cluster and Serve proxy for a test package), `deploy` (one Serve app under its own route prefix,
deleted afterwards), `stream_request` (one SSE request read by raw httpx, with every failure mode
kept as data rather than raised), `parse_metrics`, and `listening_sockets` (what a process listens on).

Invariants: nothing here leaves a process, app or connection behind on failure; every wait has a
deadline.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import httpx
import psutil
from ray import serve

SECRET = "reliability-secret-0123456789abcdef"
#: deadlines of the reliability package's ``fakes`` app (its conftest.py), which test_timeouts.py checks
FAKES_PREFILL_TIMEOUT_S = 1.5
FAKES_TOKEN_TIMEOUT_S = 1.5


def cluster_args(model: str, *, prefill: dict[str, Any] | None = None, decode: dict[str, Any] | None = None,
                 kv: dict[str, Any] | None = None, limits: dict[str, Any] | None = None,
                 router: dict[str, Any] | None = None, mode: str = "disaggregated") -> dict[str, Any]:
    """``args:`` for a small local app of ``model`` (fractional CPUs, one torch thread per replica).
    Disaggregated, every prompt is prefilled in the prefill pool (``router.prefill_path: remote``)
    unless ``router`` names a ``prefill_path``: the tests that follow a request through the prefill
    replicas keep doing so whatever its length."""
    pool = {"num_replicas": 1, "num_cpus": 0.1, "num_blocks": 128, "max_num_seqs": 32}
    args: dict[str, Any] = {
        "model": model,
        "served_model_name": "tiny",
        "mode": mode,
        "engine": {"dtype": "float32", "block_size": 16, "num_threads": 1, "decode_attention": "sdpa"},
        "decode": {**pool, **(decode or {})},
        "router": {"num_replicas": 1, "num_cpus": 0.05, "routing_stats_period_s": 0.5, **(router or {})},
        "kv": {"transport": "gloo", "host": "127.0.0.1", "secret": SECRET, "lease_s": 30, **(kv or {})},
        "limits": {"max_model_len": 4096, **(limits or {})},
    }
    if mode == "disaggregated":
        args["prefill"] = {**pool, **(prefill or {})}
        args["router"].setdefault("prefill_path", "remote")
    return args


@contextmanager
def local_serve(*by_value: ModuleType) -> Iterator[str]:
    """A Ray cluster of this process's own (``address="local"``: never one somebody else started on this
    machine) with a Serve HTTP proxy on a free 127.0.0.1 port; yields the proxy's base URL and shuts both
    down after. ``by_value``: test-support modules the replicas unpickle by value (not importable there)."""
    import ray
    from ray import cloudpickle

    from loadtests.bench_common import free_port

    os.environ["RAY_AUTH_MODE"] = "disabled"
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    for module in by_value:
        cloudpickle.register_pickle_by_value(module)
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield f"http://127.0.0.1:{port}"
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


@contextmanager
def deploy(app: Any, name: str, base: str, timeout_s: float = 180.0,
           headers: dict[str, str] | None = None) -> Iterator[str]:
    """Run ``app`` as ``name`` at ``/name``; yields its base URL; deletes the app on exit.

    ``headers`` go with the ``/ready`` polls (an API key when ``/ready`` is not public).
    """
    try:
        serve.run(app, name=name, route_prefix=f"/{name}", blocking=False)
        url = f"{base}/{name}"
        wait_ready(url, timeout_s, headers)
        yield url
    finally:
        try:
            serve.delete(name)
        except Exception as e:  # the cluster may already be going down; the package fixture stops it
            print(f"serve.delete({name!r}) failed: {e!r}")


def wait_ready(url: str, timeout_s: float, headers: dict[str, str] | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        try:
            r = httpx.get(f"{url}/ready", timeout=10, headers=headers)
            if r.status_code == 200:
                return
            last = f"HTTP {r.status_code}"
        except httpx.HTTPError as e:
            last = repr(e)
        time.sleep(0.5)
    raise TimeoutError(f"{url}/ready did not answer 200 within {timeout_s:g} s (last: {last})")


def completion_body(prompt: str | list[int], max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, **extra}


@dataclass
class StreamResult:
    """What one client saw: status, the events, the error event, timing. Never raises."""

    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    request_id: str | None = None
    texts: list[str] = field(default_factory=list)  # one per content chunk
    choice_texts: dict[int, str] = field(default_factory=dict)  # each choice's text, by its index
    # each choice's tokens, by its index, when the request asked for log-probs: (the token, its
    # alternatives as (token, log-prob), most likely first)
    choice_tokens: dict[int, list[tuple[str, list[tuple[str, float]]]]] = field(default_factory=dict)
    chunk_times: list[float] = field(default_factory=list)  # when each content chunk arrived (monotonic)
    usage_tokens: int | None = None
    finish_reason: str | None = None
    error: dict[str, Any] | None = None  # an SSE error event's "error", or a non-200 body's
    done: bool = False  # saw data: [DONE]
    transport_error: str | None = None  # the connection broke
    t_start: float = 0.0
    t_first: float | None = None
    t_end: float = 0.0
    dropped: bool = False  # the client went away on purpose
    expected_tokens: int | None = None  # for the caller's books

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.done and self.error is None and self.transport_error is None

    @property
    def ttft(self) -> float | None:
        return None if self.t_first is None else self.t_first - self.t_start


async def stream_request(client: httpx.AsyncClient, url: str, body: dict[str, Any], *,
                         drop_after: int | None = None, headers: dict[str, str] | None = None,
                         timeout_s: float = 120.0, on_first: Callable[[str], None] | None = None) -> StreamResult:
    """POST a streamed request and read it all (or ``drop_after`` content chunks, then hang up).

    ``on_first(request_id)`` is called as the first token arrives (the id is the chunks' ``id``).
    """
    res = StreamResult(t_start=time.monotonic())
    try:
        await asyncio.wait_for(_read(client, url, body, res, drop_after, headers, on_first), timeout_s)
    except (httpx.HTTPError, asyncio.TimeoutError, OSError) as e:
        res.transport_error = repr(e)
    finally:
        res.t_end = time.monotonic()
    return res


async def _read(client: httpx.AsyncClient, url: str, body: dict[str, Any], res: StreamResult,
                drop_after: int | None, headers: dict[str, str] | None,
                on_first: Callable[[str], None] | None) -> None:
    async with client.stream("POST", url, json=body, headers=headers) as r:
        res.status = r.status_code
        res.headers = dict(r.headers)
        if r.status_code != 200:
            raw = await r.aread()
            try:
                res.error = json.loads(raw)["error"]
            except (ValueError, KeyError, TypeError):
                res.error = {"message": raw.decode(errors="replace")}
            return
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                res.done = True
                return
            event = json.loads(data)
            if "error" in event:
                res.error = event["error"]
                continue
            res.request_id = res.request_id or event.get("id")
            if event.get("usage"):
                res.usage_tokens = event["usage"]["completion_tokens"]
            for choice in event.get("choices") or ():
                now = time.monotonic()
                if res.t_first is None:
                    res.t_first = now
                    if on_first is not None and res.request_id:
                        on_first(res.request_id)
                text = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                res.texts.append(text)
                res.chunk_times.append(now)
                index = choice.get("index", 0)
                res.choice_texts[index] = res.choice_texts.get(index, "") + text
                res.choice_tokens.setdefault(index, []).extend(_logprob_tokens(choice.get("logprobs")))
                res.finish_reason = choice.get("finish_reason") or res.finish_reason
            if drop_after is not None and len(res.texts) >= drop_after:
                res.dropped = True
                return  # leaving the context closes the connection mid-stream


def _logprob_tokens(lp: dict[str, Any] | None) -> list[tuple[str, list[tuple[str, float]]]]:
    """A chunk's tokens with their top alternatives, from a completions or a chat ``logprobs`` object."""
    if not lp:
        return []
    if "content" in lp:  # chat
        return [(t["token"], sorted(((a["token"], a["logprob"]) for a in t.get("top_logprobs") or ()),
                                    key=lambda x: -x[1])) for t in lp["content"] or ()]
    tops = lp.get("top_logprobs") or [None] * len(lp.get("tokens") or ())
    return [(tok, sorted((top or {}).items(), key=lambda x: -x[1]))
            for tok, top in zip(lp["tokens"], tops, strict=True)]


async def drop_before_first_token(url: str, body: dict[str, Any], after_s: float) -> None:
    """Send a request on a raw socket and hang up ``after_s`` later, before any response byte."""
    host, port, path = _split(url)
    payload = json.dumps(body).encode()
    _reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 10)
    try:
        writer.write(f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
        await writer.drain()
        await asyncio.sleep(after_s)
    finally:
        writer.close()
        try:
            await asyncio.wait_for(writer.wait_closed(), 5)
        except (OSError, asyncio.TimeoutError):
            pass


def _split(url: str) -> tuple[str, int, str]:
    u = httpx.URL(url)
    return u.host, int(u.port or 80), u.raw_path.decode()


# ---- /metrics ------------------------------------------------------------------------------------


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text → ``{'name{labels}': value}`` (labels exactly as rendered)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        out[key] = float(value)
    return out


def gauge(samples: dict[str, float], name: str) -> dict[str, float]:
    """Every sample of one metric: ``{'{labels}': value}``."""
    return {k[len(name):]: v for k, v in samples.items() if k.startswith(name + "{")}


# ---- processes -----------------------------------------------------------------------------------


def listening_sockets(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket ``pid`` listens on."""
    conns = psutil.Process(pid).net_connections(kind="tcp")
    return sorted((c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN)


def replica_processes(app: str, deployment: str) -> set[int]:
    """pids of the live ``ray::ServeReplica:<app>:<deployment>`` processes this test process's Ray started."""
    title = f"ray::ServeReplica:{app}:{deployment}"
    out: set[int] = set()
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE and p.cmdline()[:1] and p.cmdline()[0].split(".")[0] == title:
                out.add(p.pid)
        except psutil.Error:
            continue
    return out


def running_replicas(app: str, deployment: str) -> int:
    from ray.serve.schema import ReplicaState

    status = serve.status().applications[app].deployments[deployment]
    return int(status.replica_states.get(ReplicaState.RUNNING, 0))
