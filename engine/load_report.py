"""`LoadReport`: what a serving replica of either pool says of its load, for the router's policies.

Owns the one contract both pools produce and the router reads (through Serve's routing stats and
`router.loadboard`), so that neither pool imports the other. Plain values only: it crosses the Serve
controller as a dict (`dataclasses.asdict`) and back.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoadReport:
    """A replica's load, polled by the router's policies (pure functions over these)."""

    replica_id: str
    role: str  # "prefill" | "decode" | "colocated"
    num_waiting: int
    num_running: int
    outstanding_tokens: int  # prompt tokens queued or in progress (prefill); context tokens (decode)
    kv_blocks_free: int
    kv_blocks_total: int
    outbox_pending: int = 0  # prefill: handles not yet pulled, released or expired
    ready: bool = True
    # decode / colocated, cumulative since start: engine steps, seconds inside their forwards, the
    # model thread's CPU seconds in them (less than the wall seconds by what it waited for: the GIL,
    # a core) and sequences decoded (per-step time and batch = ratios of differences)
    steps: int = 0
    step_seconds: float = 0.0
    step_cpu_seconds: float = 0.0
    step_sequences: int = 0
