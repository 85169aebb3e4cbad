"""A fake worker's side of `decode_worker.scheduler.DecodeScheduler`, for its model-free tests.

Owns: `step` (schedule, check the books, count a token for each decoded sequence) and `FakeKV`, a
KV cache of rows ``(owner, position)`` on which a test executes a `SchedulerOutput`'s swaps in
protocol order, writes tokens and block copies, and reads back what a sequence would attend to.
"""

from __future__ import annotations

from decode_worker.scheduler import DecodeScheduler
from decode_worker.seq_state import SchedulerOutput, SeqState

Row = tuple[str, int] | None


def step(sched: DecodeScheduler) -> list[str]:
    out = sched.schedule()
    sched.check_integrity()
    for s in out.decode:
        sched.on_token(s.seq_id)
    return [s.seq_id for s in out.decode]


class FakeKV:
    """``rows[block * block_size + offset]``: who wrote that slot, for which position."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.bs = block_size
        self.rows: list[Row] = [None] * (num_blocks * block_size)
        self.host: dict[str, list[list[Row]]] = {}  # swapped-out sequences' blocks

    def swaps(self, out: SchedulerOutput) -> None:
        """(a) swap-outs, before anything writes; (b) swap-ins."""
        bs = self.bs
        for seq, ids in out.swap_out:
            self.host[seq.seq_id] = [self.rows[b * bs : (b + 1) * bs] for b in ids]
        for seq, ids in out.swap_in:
            for b, data in zip(ids, self.host.pop(seq.seq_id), strict=True):
                self.rows[b * bs : (b + 1) * bs] = data

    def write(self, seq: SeqState, pos: int, owner: str | None = None) -> None:
        self.rows[seq.block_ids[pos // self.bs] * self.bs + pos % self.bs] = (owner or seq.seq_id, pos)

    def copy(self, src: int, dst: int) -> None:
        bs = self.bs
        self.rows[dst * bs : (dst + 1) * bs] = self.rows[src * bs : (src + 1) * bs]

    def read(self, seq: SeqState) -> list[Row]:
        """The rows of every position whose KV ``seq`` has."""
        return [self.rows[seq.block_ids[p // self.bs] * self.bs + p % self.bs] for p in range(seq.num_tokens)]
