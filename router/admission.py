"""Admission control of one router replica: at most ``limit`` generations in flight, past it 429 at once.

Why here and not in the pools: in disaggregated mode the client's 200 and token 0 leave as soon as
the prefill answers, before the decode pool has seen the request. A decode pool that is full can
then only break the stream off with an in-band error, after a 200. So the router refuses up front
what the decode pool could not hold (`cluster.config` sizes the bound from the decode pool:
replicas × (``max_num_seqs`` + ``max_queue``), shared among router replicas), and what it admits
queues in the pools, never dropped for load.

Invariants: `enter` either counts the request or raises the 429 `APIError` (with ``Retry-After``);
every counted request is `leave`-d exactly once (the generation's ``finally``). Event-loop only.
"""

from __future__ import annotations

from router.errors import queue_full


class Admission:
    """A non-blocking counter of generations in flight (see the module docstring)."""

    def __init__(self, limit: int | None, retry_after_s: float = 1.0) -> None:
        if limit is not None and limit < 1:
            raise ValueError(f"admission limit must be at least 1, got {limit}")
        self.limit = limit
        self.retry_after_s = retry_after_s
        self.in_flight = 0
        self.refused = 0

    def enter(self) -> None:
        if self.limit is not None and self.in_flight >= self.limit:
            self.refused += 1
            raise queue_full(self.retry_after_s)
        self.in_flight += 1

    def leave(self) -> None:
        assert self.in_flight > 0, "leave() without enter()"
        self.in_flight -= 1
