"""`LoadReport`: what a serving replica of either pool says of its load, for the router's policies.

Owns the one contract both pools produce and the router reads (through Serve's routing stats and
`router.loadboard`), so that neither pool imports the other. Plain values only: it crosses the Serve
controller as a dict (`dataclasses.asdict`) and back.

It is also how decode replicas learn the prefill pool's KV sources: a prefill replica reports where
its KV source listens (``kv_host``, ``kv_port``), and `kv_sources` turns a pool's reports into the set
a decode replica meets at start-up and on every change (`kv_transfer.keeper`).

Also owns the board: the latest reports of each deployment as this process's Serve handles see them
(written by `router.replica_router` in any process holding a handle: the HTTP router, and decode
replicas watching the prefill pool). It is written from the handle's routing loop (a thread of its
own) and read from the event loop, so a deployment's reports are replaced as one new dict, never
mutated in place; a replica Serve no longer lists disappears at the next update.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
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
    # prefill, cumulative since start: prompt tokens its forwards computed and seconds inside them (the
    # pool's measured prefill rate = a ratio of differences, `router.load_estimates.prefill_rate`)
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    # prefill: where its KV source listens ("" / 0 until it does)
    kv_host: str = ""
    kv_port: int = 0
    # decode: prefill KV sources it is paired with now, and pulls since start that found no pair
    # with their source (each waited for a meeting inside its request: a source not met in time)
    kv_pairs: int = 0
    kv_pulls_unpaired: int = 0
    # decode / colocated, now: what the path decision (`router.path_choice`) reads of a decode replica.
    # The context its running streams attend to, the tightest TPOT objective among them (None: none
    # has one), the prompt tokens still to prefill here (queued and in progress), and the replica's own
    # step-time fit (`engine.step_model.StepTimeModel`'s four coefficients, `engine.step_fit`; None
    # before it has one)
    running_context_tokens: int = 0
    running_tpot_s: float | None = None
    local_queue_tokens: int = 0
    step_fit: tuple[float, float, float, float] | None = None

    @property
    def kv_source(self) -> tuple[str, int] | None:
        return (self.kv_host, self.kv_port) if self.kv_host and self.kv_port else None


def kv_sources(reports: Iterable[LoadReport]) -> list[tuple[str, int]]:
    """The KV sources of a prefill pool's replicas (draining ones too: their outboxes are still pulled)."""
    return sorted({s for r in reports if (s := r.kv_source) is not None})


_board: dict[str, Mapping[str, LoadReport]] = {}


def publish(deployment: str, reports: Mapping[str, LoadReport]) -> None:
    """Replace the reports of one deployment (keyed by Serve replica id)."""
    _board[deployment] = dict(reports)


def snapshot(deployment: str) -> dict[str, LoadReport]:
    """The latest reports of one deployment (empty before its handle's first update)."""
    return dict(_board.get(deployment, {}))


def deployments() -> list[str]:
    return sorted(_board)
