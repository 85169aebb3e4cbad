"""The servers the goodput benchmark compares, and how each is started and read.

Owns `ServerSpec` and `SERVERS` (the new default, always-remote disaggregated, colocated, colocated
chunked, vLLM's CPU build), `bench_yaml` (a pdserve YAML as the benchmark runs it), `started` (a
running server: its base URL and the load gauges that say it is idle) and `labelled_counts` (a
counter's samples at ``/metrics`` by their labels, for the path decisions and the router's own
judgement of each request).

Invariants: every pdserve server runs with the benchmark's objectives in its ``objectives:`` section,
so the router routes and counts by the objectives the client judges by, and with one ``engine.dtype``
for all (vLLM's peer computes in what ``dtype: auto`` resolves to), so no server wins by its dtype;
the YAML a server ran is written beside its log and recorded in the result. A YAML that is missing
is refused naming the server and the file. vLLM's peer that cannot be installed or started raises
`PeerUnavailable`, which the benchmark records as a skip with its reason.
"""

from __future__ import annotations

import contextlib
import copy
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import httpx
import yaml

from loadtests.bench_common import LOG_DIR, PDSERVE_LOAD_GAUGES, REPO, ServerProcess

VLLM_LOAD_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting")


@dataclass(frozen=True)
class ServerSpec:
    name: str
    kind: Literal["pdserve", "vllm"]
    config: str | None = None  # pdserve: the repo-relative Serve YAML
    # pdserve disaggregated: "auto" (each request's path chosen at the router) or "remote"; None: no prefill pool
    prefill_path: str | None = None


SERVERS: dict[str, ServerSpec] = {s.name: s for s in (
    ServerSpec("default", "pdserve", "deploy/local.yaml", prefill_path="auto"),
    # the default's own layout with every prompt sent to the prefill pool: the two differ in the path alone
    ServerSpec("remote", "pdserve", "deploy/local.yaml", prefill_path="remote"),
    ServerSpec("colocated", "pdserve", "deploy/bench-colocated.yaml"),
    ServerSpec("colocated-chunked", "pdserve", "deploy/bench-colocated-chunked.yaml"),
    ServerSpec("vllm", "vllm"),
)}


def pick(names: str) -> list[ServerSpec]:
    """The comma-separated ``names`` as specs, in the order given; an unknown one is refused, naming the known."""
    out = []
    for n in (x.strip() for x in names.split(",")):
        if n and n not in SERVERS:
            raise ValueError(f"unknown server {n!r}; servers: {', '.join(SERVERS)}")
        if n:
            out.append(SERVERS[n])
    if not out:
        raise ValueError(f"no server named; servers: {', '.join(SERVERS)}")
    return out


def bench_yaml(doc: Mapping[str, Any], objectives: Mapping[str, Any] | None, dtype: str | None,
               prefill_path: str | None = None) -> dict[str, Any]:
    """A Serve YAML (parsed) with the benchmark's objectives, dtype and (disaggregated) prefill path set in
    its one pdserve application."""
    out = copy.deepcopy(dict(doc))
    apps = out.get("applications") or []
    if len(apps) != 1:
        raise ValueError(f"the goodput benchmark runs a YAML with one application, this one has {len(apps)}")
    args = apps[0].setdefault("args", {})
    if objectives is not None:
        args["objectives"] = copy.deepcopy(dict(objectives))
    if prefill_path is not None:
        args.setdefault("router", {})["prefill_path"] = prefill_path
    if dtype is not None:
        args.setdefault("engine", {})["dtype"] = dtype
        for pool in ("prefill", "decode"):
            if isinstance(args.get(pool), dict) and "dtype" in args[pool]:
                args[pool]["dtype"] = dtype  # a pool's own dtype would override the engine's
    return out


def write_bench_yaml(spec: ServerSpec, objectives: Mapping[str, Any] | None, dtype: str | None,
                     tag: str) -> Path:
    """``spec``'s YAML as the benchmark runs it, written under the benchmark's log folder."""
    if spec.config is None:
        raise ValueError(f"server {spec.name!r} has no pdserve YAML")
    src = REPO / spec.config
    if not src.exists():
        raise FileNotFoundError(f"server {spec.name!r}: {spec.config} does not exist (leave it out with --servers)")
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    path = LOG_DIR / f"goodput-{spec.name}-{tag}.yaml"
    path.write_text(yaml.safe_dump(bench_yaml(yaml.safe_load(src.read_text()), objectives, dtype, spec.prefill_path),
                                    sort_keys=False))
    return path


@dataclass(frozen=True)
class Live:
    """A started server: where it answers and which gauges read 0 when it is idle."""

    base_url: str
    load_gauges: Sequence[str]
    describe: dict[str, Any]


@contextlib.contextmanager
def started(spec: ServerSpec, config: Path | None, vllm_venv: Path) -> Iterator[Live]:
    """``spec`` running (pdserve from ``config``; vLLM's peer from ``vllm_venv``) until the block ends."""
    if spec.kind == "vllm":
        from loadtests.vllm_peer import VllmPeer

        peer = VllmPeer.prepare(vllm_venv)
        with peer.serve() as base_url:
            yield Live(base_url, VLLM_LOAD_GAUGES, {"version": peer.version, **peer.describe()})
        return
    if config is None:
        raise ValueError(f"server {spec.name!r} needs its YAML")
    with ServerProcess(config) as server:
        yield Live(server.base_url, PDSERVE_LOAD_GAUGES, {"config": spec.config, "log": str(server.log_path)})


_SAMPLE = re.compile(r"^([\w:]+)(?:\{([^}]*)\})? (\S+)$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_labelled(text: str, name: str, labels: Sequence[str]) -> dict[str, float]:
    """The samples of ``name`` in a Prometheus text page, keyed by the values of ``labels`` joined by '/'."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m or m.group(1) != name:
            continue
        got = dict(_LABEL.findall(m.group(2) or ""))
        key = "/".join(got.get(k, "") for k in labels)
        out[key] = out.get(key, 0.0) + float(m.group(3))
    return out


def labelled_counts(base_url: str, name: str, labels: Sequence[str]) -> dict[str, float] | None:
    """`parse_labelled` of the server's ``/metrics``; None if it does not answer."""
    try:
        return parse_labelled(httpx.get(f"{base_url}/metrics", timeout=10).text, name, labels)
    except httpx.HTTPError:
        return None


def counts_between(before: Mapping[str, float] | None, after: Mapping[str, float] | None) -> dict[str, float] | None:
    """What a counter gained between two scrapes, per label key (None if either scrape failed)."""
    if before is None or after is None:
        return None
    return {k: round(v - before.get(k, 0.0), 6) for k, v in sorted(after.items()) if v - before.get(k, 0.0)}
