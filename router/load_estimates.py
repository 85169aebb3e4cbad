"""Estimates the path decision reads from the replicas' load reports: the prefill pool's rate and wait,
and a decode replica's observed step.

Owns: `prefill_rate` (prompt tokens per second of forward, from two reports' cumulative counters),
`pool_prefill_rate` (the same over a pool, replica by replica), `prefill_wait_s` (how long a new
prompt waits in the prefill pool: the least loaded ready replica's queued tokens at the measured rate,
since the prefill policies send it there or near) and `observed_step` (a decode replica's mean step
time and batch between two reports).

Why ratios of differences: the reports carry cumulative counters (`engine.load_report.LoadReport`), so
a window is the difference of two of them; a window without work (or a restarted replica, whose
counters went back) says nothing, and the caller keeps its earlier estimate (None here).
Pure: no clock, no board; the caller keeps the previous reports.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from engine.load_report import LoadReport


def prefill_rate(prev: LoadReport, cur: LoadReport) -> float | None:
    """Prompt tokens per second of forward between two reports of one prefill replica."""
    tokens = cur.prefill_tokens - prev.prefill_tokens
    seconds = cur.prefill_seconds - prev.prefill_seconds
    if tokens <= 0 or seconds <= 0:
        return None
    return tokens / seconds


def pool_prefill_rate(prev: Mapping[str, LoadReport], cur: Mapping[str, LoadReport]) -> float | None:
    """One replica's rate, pooled over the replicas in both snapshots (tokens over seconds in all)."""
    tokens = seconds = 0.0
    for rid, now in cur.items():
        before = prev.get(rid)
        if before is None or prefill_rate(before, now) is None:
            continue
        tokens += now.prefill_tokens - before.prefill_tokens
        seconds += now.prefill_seconds - before.prefill_seconds
    return tokens / seconds if seconds > 0 else None


def prefill_wait_s(reports: Sequence[LoadReport], rate_tps: float) -> float:
    """The queue a new prompt meets in the prefill pool: the least loaded ready replica's outstanding
    tokens at ``rate_tps`` (all replicas when none is ready, as the policies do); inf with none."""
    if not rate_tps > 0:
        raise ValueError(f"rate_tps must be positive, got {rate_tps}")
    ready = [r for r in reports if r.ready] or list(reports)
    if not ready:
        return float("inf")
    return min(r.outstanding_tokens for r in ready) / rate_tps


@dataclass(frozen=True)
class ObservedStep:
    step_s: float  # mean seconds per step in the window
    batch: float  # mean sequences per step


def observed_step(prev: LoadReport, cur: LoadReport) -> ObservedStep | None:
    """A decode replica's mean step between two of its reports; None for a window without steps."""
    steps = cur.steps - prev.steps
    seconds = cur.step_seconds - prev.step_seconds
    if steps <= 0 or seconds <= 0:
        return None
    return ObservedStep(seconds / steps, (cur.step_sequences - prev.step_sequences) / steps)
