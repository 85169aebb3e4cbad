"""Draining a running app before it stops: out of rotation first, then empty, then gone.

Owns: `drain_app`, the sequence ``pdserve drain`` and a SIGTERM'd ``pdserve serve`` run, and
`in_flight`, the app's work in progress read from its own ``/metrics``.

The sequence:
1. set the app's drain flag (`router.drain`): every router replica's ``/ready`` answers 503
   ``draining``, so a load balancer that health-checks ``/ready`` stops sending (``/health`` stays
   200: the process is fine, it is just leaving);
2. confirm ``/ready`` turned false, then hold ``announce_s`` — the balancer's check interval —
   while requests that still arrive are served as usual (nothing is refused for draining);
3. wait until nothing is in flight: no generation in the router, nothing running or waiting on any
   prefill or decode replica, no KV handle waiting in an outbox — idle for ``settle_s``, longer
   than the replicas' load-report period, so a stale report cannot pass for idle;
4. return; the caller then stops Serve (each replica's own shutdown is then a formality).

Invariants: every wait is bounded (``timeout_s`` overall); a drain that times out says what was
still in flight; `undrain` puts the app back in rotation.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from router.drain import set_draining

_BUSY_GAUGES = ("pdserve:router_requests_in_flight", "pdserve:num_requests_running", "pdserve:num_requests_waiting",
                "pdserve:kv_outbox_pending")


@dataclass(frozen=True)
class DrainResult:
    drained: bool  # nothing was left in flight when it returned
    ready_false_s: float  # from setting the flag to /ready answering 503
    total_s: float
    in_flight_at_start: dict[str, float] = field(default_factory=dict)
    left: dict[str, float] = field(default_factory=dict)  # what was still busy (a timed-out drain)


def _get(url: str, api_key: str | None, timeout_s: float = 5.0) -> tuple[int, str]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout_s) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def in_flight(base_url: str, api_key: str | None = None) -> dict[str, float]:
    """Non-zero work-in-progress gauges of the app, ``{"name{labels}": value}`` (empty: idle)."""
    status, text = _get(f"{base_url}/metrics", api_key)
    if status != 200:
        raise RuntimeError(f"{base_url}/metrics answered {status}: {text[:200]}")
    busy: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in _BUSY_GAUGES and s.value:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                busy[f"{s.name}{{{labels}}}"] = s.value
    return busy


def drain_app(
    app_name: str,
    base_url: str,
    *,
    announce_s: float = 2.0,
    timeout_s: float = 60.0,
    api_key: str | None = None,
    poll_s: float = 0.25,
    settle_s: float = 1.5,
) -> DrainResult:
    """Take the app out of rotation and wait for it to empty (the module docstring's steps 1-3).

    The caller must be connected to the app's Ray cluster (``ray.init(address=...)``).
    """
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    start = in_flight(base_url, api_key)
    set_draining(app_name, True)
    while True:
        status, body = _get(f"{base_url}/ready", api_key)
        if status == 503 and "draining" in body:
            break
        if time.monotonic() > deadline:
            return DrainResult(False, float("nan"), time.monotonic() - t0, start, {"/ready still": float(status)})
        time.sleep(poll_s)
    ready_false_s = time.monotonic() - t0
    time.sleep(max(0.0, min(announce_s, deadline - time.monotonic())))
    idle_since: float | None = None
    left = start
    while time.monotonic() <= deadline:
        left = in_flight(base_url, api_key)
        now = time.monotonic()
        idle_since = (idle_since or now) if not left else None
        if idle_since is not None and now - idle_since >= settle_s:
            return DrainResult(True, ready_false_s, now - t0, start, {})
        time.sleep(poll_s)
    return DrainResult(False, ready_false_s, time.monotonic() - t0, start, left)


def undrain(app_name: str) -> None:
    """Clear the drain flag: ``/ready`` answers 200 again (within the routers' cache period)."""
    set_draining(app_name, False)
