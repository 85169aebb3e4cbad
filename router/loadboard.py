"""The latest load report of every replica, as seen by this process's deployment handles.

Owns: the conversion between `LoadReport` and the plain dict a replica's ``record_routing_stats``
returns, and the router's door to the process-local board the Serve request router
(`router.replica_router`) writes each time Serve hands it fresh replica info (`publish`, `snapshot`,
`deployments`: the board itself lives in `engine.load_report`, where decode replicas read the prefill
pool's reports too without importing the router).

Invariants: as the board's (see `engine.load_report`). This module must stay importable by
reference (the request router class is shipped by value and finds the board through it).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from typing import Any

from engine.load_report import LoadReport, deployments, publish, snapshot

__all__ = ["deployments", "publish", "report_to_stats", "snapshot", "stats_to_report"]

_FIELDS = {f.name for f in dataclasses.fields(LoadReport)}

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
    if values.get("step_fit") is not None:  # a tuple may come back as a list from the controller
        values["step_fit"] = tuple(values["step_fit"])
    return LoadReport(**values)
