"""The latest load report of every replica, as seen by this process's deployment handles.

Owns: the process-local board the Serve request router (`router.replica_router`) writes each time
Serve hands it fresh replica info, and the conversion between `LoadReport` and the plain dict a
replica's ``record_routing_stats`` returns.

Invariants: the board is written from the handle's routing loop (a thread of its own) and read from
the HTTP loop, so each deployment's reports are replaced as one new dict, never mutated in place;
a replica Serve no longer lists disappears from the board at the next update. This module must stay
importable by reference (the request router class is shipped by value and finds the board here).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from engine.load_report import LoadReport

_board: dict[str, Mapping[str, LoadReport]] = {}

_FIELDS = {f.name for f in dataclasses.fields(LoadReport)}


def report_to_stats(report: LoadReport) -> dict[str, Any]:
    """A `LoadReport` as Serve routing stats (plain values only: the controller relays them)."""
    return dataclasses.asdict(report)


def stats_to_report(replica_id: str, stats: Mapping[str, Any], role: str = "") -> LoadReport:
    """Routing stats back to a `LoadReport`; a replica that has not reported yet counts as idle."""
    values: dict[str, Any] = {"role": role, "num_waiting": 0, "num_running": 0, "outstanding_tokens": 0,
                              "kv_blocks_free": 0, "kv_blocks_total": 0}
    values.update((k, v) for k, v in stats.items() if k in _FIELDS)
    values["replica_id"] = replica_id
    return LoadReport(**values)


def publish(deployment: str, reports: Mapping[str, LoadReport]) -> None:
    """Replace the reports of one deployment (keyed by Serve replica id)."""
    _board[deployment] = dict(reports)


def snapshot(deployment: str) -> dict[str, LoadReport]:
    """The latest reports of one deployment (empty before its handle first routed anything)."""
    return dict(_board.get(deployment, {}))


def deployments() -> list[str]:
    return sorted(_board)
