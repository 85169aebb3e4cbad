"""The latest load report of every replica, as seen by this process's deployment handles.

Owns: the conversion between `LoadReport` and the plain dict a replica's ``record_routing_stats``
returns, and the router's door to the process-local board the Serve request router
(`router.replica_router`) writes each time Serve hands it fresh replica info (`publish`, `snapshot`,
`deployments`: the board itself lives in `engine.load_report`, where decode replicas read the prefill
pool's reports too without importing the router), and the actors this process saw die (`mark_gone`,
`gone`: a call's stream learns of a death before Serve's router does, and the continuations it
causes must not be sent to the dead replica, `router.replica_router`).

Invariants: as the board's (see `engine.load_report`). This module must stay importable by
reference (the request router class is shipped by value and finds the board through it).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import deque
from collections.abc import Mapping
from typing import Any

from engine.load_report import LoadReport, deployments, publish, snapshot

__all__ = ["deployments", "gone", "mark_gone", "publish", "report_to_stats", "snapshot", "stats_to_report"]

_FIELDS = {f.name for f in dataclasses.fields(LoadReport)}

_GONE_KEPT = 1024  # actor ids are never reused; the oldest are forgotten past this many
_gone: deque[str] = deque(maxlen=_GONE_KEPT)
_gone_lock = threading.Lock()  # written on the event loop, read on a handle's routing thread


def mark_gone(actor_id: str) -> None:
    """The actor (its id in hex) died: a call to it failed because it is gone."""
    with _gone_lock:
        if actor_id not in _gone:
            _gone.append(actor_id)


def gone() -> frozenset[str]:
    """The actors (ids in hex) this process saw die."""
    with _gone_lock:
        return frozenset(_gone)


#: routing stats' wall-clock time of the report: it changes with every poll, so a router sees a
#: replica's stats stop changing when the replica stops answering (`router.replica_router`)
REPORTED_AT = "reported_at"


def report_to_stats(report: LoadReport) -> dict[str, Any]:
    """A `LoadReport` as Serve routing stats (plain values only: the controller relays them), with
    the time of the report (`REPORTED_AT`)."""
    return {**dataclasses.asdict(report), REPORTED_AT: time.time()}


def stats_to_report(replica_id: str, stats: Mapping[str, Any], role: str = "") -> LoadReport:
    """Routing stats back to a `LoadReport`; a replica that has not reported yet counts as idle."""
    values: dict[str, Any] = {"role": role, "num_waiting": 0, "num_running": 0, "outstanding_tokens": 0,
                              "kv_blocks_free": 0, "kv_blocks_total": 0}
    values.update((k, v) for k, v in stats.items() if k in _FIELDS)
    values["replica_id"] = replica_id
    return LoadReport(**values)
