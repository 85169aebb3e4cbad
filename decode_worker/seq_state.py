"""A decode sequence's state, and the contract of one scheduling decision (`SchedulerOutput`).

Owns the types that cross from `decode_worker.scheduler.DecodeScheduler` (which decides) to
`decode_worker.worker.DecodeWorker` (which executes), so the worker's side of the contract reads
apart from the scheduler's policy.

Life cycle of a sequence (one choice of a request, named by its sequence id)::

    add ─▶ WAITING ─(admitted: blocks for num_tokens + 1 reserved)─▶ TRANSFERRING
    TRANSFERRING ─on_transfer_done─▶ RUNNING        TRANSFERRING ─on_transfer_failed─▶ FINISHED
    RUNNING ─(swap_out)─▶ SWAPPED ─(swap_in)─▶ RUNNING        any ─finish─▶ FINISHED

Protocol: the worker executes one `SchedulerOutput` completely before calling `schedule` again, in
this order: (a) ``swap_out``: copy those device blocks to host. The scheduler has already freed them
and may have handed the same ids out in this very output, so the copies must finish before (b)-(d)
write anything. (b) ``swap_in``: copy the host copy into the listed ids (``seq.block_ids`` may hold
one more, empty block for the next token). (c) ``admitted``: start pulling KV into
``seq.block_ids``, then report `on_transfer_done` / `on_transfer_failed`. (d) step ``decode``
(token at position ``num_tokens``), `on_token` each, `finish` those that ended. ``failed`` ones are
already finished (they outgrew the whole pool, or broke a deadlock, see `DecodeScheduler.schedule`):
end them with an error.
Before `finish` on a TRANSFERRING sequence, the worker must stop any transfer into its blocks.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    TRANSFERRING = "transferring"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


@dataclass(eq=False)  # identity: queues remove by `is`, not by field values
class SeqState:
    seq_id: str
    num_tokens: int  # tokens whose KV is (or, once transferred, will be) cached; +1 per decode step
    arrival: float  # FCFS order; ties broken by insertion order
    block_ids: list[int] = field(default_factory=list)  # this seq's decode-pool blocks, in order
    status: SeqStatus = SeqStatus.WAITING
    num_swapped_blocks: int = 0  # blocks of KV held on host while SWAPPED
    order: int = 0  # insertion number, the FCFS tie-break
    forks: list[str] = field(default_factory=list)  # a head, until its KV is in: its forks' ids
    fork_of: str | None = None  # a fork, until its head's KV is in: the head's id
    cow: list[tuple[int, int]] = field(default_factory=list)  # a fork, until then: (head's block, its copy)


@dataclass
class SchedulerOutput:
    admitted: list[SeqState] = field(default_factory=list)
    swap_in: list[tuple[SeqState, list[int]]] = field(default_factory=list)  # ids to copy host KV into
    swap_out: list[tuple[SeqState, list[int]]] = field(default_factory=list)  # ids to copy to host
    decode: list[SeqState] = field(default_factory=list)  # oldest first; each has its next slot
    failed: list[SeqState] = field(default_factory=list)  # ended by the scheduler (`DecodeScheduler.schedule`)
