"""`load_report`: a decode (or colocated) replica's `engine.load_report.LoadReport`, built from its state.

Owns what a decode worker tells the router of its load: queue and batch sizes (the scheduler's
queues), outstanding tokens (every live stream's prompt and tokens so far), free KV blocks, the
cumulative step counters, and what the router's path decision (`router.path_choice`) reads: the
running streams' context and tightest TPOT objective, the prompt tokens still to prefill here, and
the replica's own step-time fit.

It reads the worker through `WorkerLoad`, the attributes a `decode_worker.worker.DecodeWorker` has,
so the report is a pure function of state the event loop owns (it is called there, between steps)
and can be checked without a model.

Invariants: nothing is mutated; the running count covers every admitted sequence (transferring and
swapped-out ones too); a local prompt is counted once per request (its group's head), while it
waits and while it is prefilled.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from decode_worker.local_prefill import LocalPrefill
from decode_worker.scheduler import DecodeScheduler
from decode_worker.seq_state import SeqStatus
from decode_worker.step_budget import StepBudget
from decode_worker.stream import Stream
from engine.block_pool import BlockPool
from engine.load_report import LoadReport


class WorkerLoad(Protocol):
    """What `load_report` reads of a decode worker (all owned by its event loop)."""

    @property
    def replica_id(self) -> str: ...
    @property
    def colocated(self) -> bool: ...
    @property
    def scheduler(self) -> DecodeScheduler: ...
    @property
    def pool(self) -> BlockPool: ...
    @property
    def streams(self) -> Mapping[str, Stream]: ...  # by sequence id
    @property
    def prefilling(self) -> LocalPrefill: ...
    @property
    def budget(self) -> StepBudget: ...
    @property
    def num_steps(self) -> int: ...
    @property
    def step_seconds(self) -> float: ...
    @property
    def step_sequences(self) -> int: ...
    @property
    def step_cpu_seconds(self) -> float: ...


@dataclass(frozen=True)
class PathLoad:
    """What the router's path decision reads of this replica (the `LoadReport` fields of that name)."""

    running_context_tokens: int
    running_tpot_s: float | None
    local_queue_tokens: int
    step_fit: tuple[float, float, float, float] | None


def load_report(w: WorkerLoad) -> LoadReport:
    s = w.scheduler
    path = path_load(w)
    return LoadReport(
        replica_id=w.replica_id,
        role="colocated" if w.colocated else "decode",
        num_waiting=s.num_waiting,
        num_running=s.num_running + s.num_transferring + s.num_swapped,
        outstanding_tokens=sum(len(st.req.prompt_token_ids) + len(st.generated) for st in w.streams.values()),
        kv_blocks_free=w.pool.num_free_blocks,
        kv_blocks_total=w.pool.num_blocks,
        steps=w.num_steps,
        step_seconds=w.step_seconds,
        step_sequences=w.step_sequences,
        step_cpu_seconds=w.step_cpu_seconds,
        running_context_tokens=path.running_context_tokens,
        running_tpot_s=path.running_tpot_s,
        local_queue_tokens=path.local_queue_tokens,
        step_fit=path.step_fit,
    )


def path_load(w: WorkerLoad) -> PathLoad:
    """The running streams' context and tightest TPOT objective, the prompt tokens still to prefill
    here (admitted, and waiting without a KV handle), the step fit's coefficients."""
    context, tpots, queued = 0, [], sum(w.prefilling.remaining())
    for st in w.streams.values():
        seq = w.scheduler.get(st.seq_id)
        if seq is None:
            continue
        if seq.status is SeqStatus.RUNNING:
            context += seq.num_tokens
            if st.req.tpot_s is not None:
                tpots.append(st.req.tpot_s)
        elif seq.status is SeqStatus.WAITING and st.req.handle is None and st.index == st.req.choices[0].index:
            queued += len(st.req.kv_token_ids)
    fit = w.budget.fit.model()
    return PathLoad(context, min(tpots, default=None), queued,
                    None if fit is None else (fit.base_s, fit.per_seq_s, fit.per_context_token_s,
                                              fit.per_prefill_token_s))
