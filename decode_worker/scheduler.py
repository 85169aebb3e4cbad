"""The decode pool's scheduler: pure Python, no model, no device; decides, the worker executes.

Preemption is by swap, never recompute: recomputing a victim's KV is a prefill on the decode pool, which
disaggregation exists to avoid (it stalls the batch); swap costs host memory and two copies.

Policy: each `schedule` call (1) gives every running sequence, oldest first, a slot for its next
token, appending a block at a block boundary; with no free block it swaps out the most recently
arrived running sequence other than itself (alone, it swaps out itself); (2) resumes swapped
sequences oldest first when their blocks plus the watermark fit; (3) admits waiting ones in strict
FCFS order, only when nothing is swapped, when ``free - needed >= watermark_blocks`` and fewer than
``max_num_seqs`` are live. The head is never overtaken, so a big request cannot starve.

The sequence's states and what the worker does with a `SchedulerOutput` are in
`decode_worker.seq_state`.

Forks (the ``n`` choices of one request): ``add(head, ..., forks=ids)`` queues the head with its
forks, one sequence each, created WAITING with it but queued as one: the group is admitted together
when its blocks (the head's ``num_tokens + 1`` slots, one block per fork) fit above the watermark
and its size fits ``max_num_seqs``. At admission each fork shares the head's full prompt blocks by
reference and gets one block of its own: its slot for token 0's KV, which for a prompt that ends
mid-block is a copy of the head's partial last block (`engine.block_pool.fork_for_append`:
copy-on-write; with ``share_prompt`` off, each fork copies every block of the head's). The KV
arrives into the head's blocks only; `on_transfer_done` of the head moves the whole group to
RUNNING and returns those copies, which the worker makes before the next step (the head's blocks
hold the KV then, and nothing else writes them). From then on the forks are independent
sequences: each grows, is swapped out (dropping only its own references: a block its siblings
share stays put, a host copy of it goes with the swapped seq) and swapped back into blocks of its
own, and finishes on its own. Finishing a head before its KV is in (abort, failed transfer)
finishes its forks too: they have nothing to run on; finishing a fork then only drops it.

Invariants (`check_integrity`): each live sequence is in exactly the queue its status names (a
waiting fork in none: its head is queued for it); each block's ref count is the number of live
sequences whose table names it; a running sequence's next slot is in a block of its own (ref 1);
swapped blocks stay within the swap space.
"""

from __future__ import annotations

import bisect
import operator
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from decode_worker.seq_state import SchedulerOutput, SeqState, SeqStatus
from engine.block_pool import BlockPool, fork_for_append
from engine.config import EngineConfig
from engine.errors import ContextLengthError


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = EngineConfig.max_num_seqs  # running + transferring + swapped
    watermark_blocks: int = 1  # kept free at admission and resume so running sequences can grow
    max_swap_blocks: int = 4096  # host blocks for swapped-out KV; keep it a few times num_blocks
    share_prompt: bool = True  # forks share the prompt's full blocks (off where a decode step may
    # rewrite a sequence's whole KV: a RoPE recomputed at a crossing; then each fork copies them all)


_fcfs = operator.attrgetter("arrival", "order")  # sort key of every queue but transferring


class DecodeScheduler:
    """Queues and block decisions of one decode replica; see the module docstring."""

    def __init__(self, config: SchedulerConfig, pool: BlockPool) -> None:
        self.config = config
        self.pool = pool
        self._seqs: dict[str, SeqState] = {}  # live only: finished ones are dropped
        self._waiting: list[SeqState] = []  # each list sorted by _fcfs
        self._transferring: dict[str, SeqState] = {}
        self._running: list[SeqState] = []
        self._swapped: list[SeqState] = []
        self._swap_used = self._next_order = 0  # host blocks in use; insertion counter

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.pool.block_size)

    def _group_blocks(self, seq: SeqState) -> int:
        """Blocks a group takes at admission: the head's slots for num_tokens + 1, one per fork (or,
        not sharing, the same as the head's)."""
        per_fork = 1 if self.config.share_prompt else self._blocks_for(seq.num_tokens + 1)
        return self._blocks_for(seq.num_tokens + 1) + per_fork * len(seq.forks)

    def add(self, seq_id: str, num_tokens: int, arrival: float, forks: Sequence[str] = ()) -> SeqState:
        """Queue a sequence whose KV for ``num_tokens`` tokens will arrive by transfer; ``forks``: the
        ids of the sequences that continue the same KV beside it (see the module docstring)."""
        if num_tokens < 1:
            raise ValueError(f"{seq_id}: num_tokens must be >= 1, got {num_tokens}")
        ids = [seq_id, *forks]
        if len(set(ids)) != len(ids) or any(i in self._seqs for i in ids):
            raise ValueError(f"{seq_id}: already scheduled (or a repeated fork id)")
        if len(ids) > self.config.max_num_seqs:
            raise ValueError(f"{seq_id}: {len(ids)} sequences exceed max_num_seqs {self.config.max_num_seqs}")
        seq = SeqState(seq_id, num_tokens, arrival, order=self._next_order, forks=list(forks))
        need = self._group_blocks(seq)
        if need + self.config.watermark_blocks > self.pool.num_blocks:
            pool = f"the decode pool has {self.pool.num_blocks} (watermark {self.config.watermark_blocks})"
            what = f"{num_tokens} tokens" + (f" in {len(ids)} sequences" if forks else "")
            raise ContextLengthError(f"{seq_id}: {what} need {need} blocks, {pool}")
        self._next_order += 1
        self._seqs[seq_id] = seq
        for fid in forks:
            self._seqs[fid] = SeqState(fid, num_tokens, arrival, order=seq.order, fork_of=seq_id)
        bisect.insort(self._waiting, seq, key=_fcfs)
        return seq

    def schedule(self) -> SchedulerOutput:
        """Decide one iteration: grow/preempt running, resume swapped, admit waiting.

        A running seq that finds no block and no victim fitting the swap space waits a step (it is
        left out of ``decode``). Two cases end a sequence instead (listed in ``failed``): its next
        token needs more blocks than the pool has, or every running seq waits so and no transfer is
        in flight, a deadlock, broken by ending the youngest. Size ``max_swap_blocks`` well above
        the pool (a few times ``num_blocks``) and neither happens in practice.
        """
        out = SchedulerOutput()
        stalled = self._grow_running(out)
        while stalled and len(stalled) == len(self._running) and not self._transferring:
            victim = self._running[-1]  # deadlock (see above): end the youngest rather than hang
            self._release(victim)
            out.failed.append(victim)
            stalled = self._grow_running(out)
        swapped_now = {seq.seq_id for seq, _ in out.swap_out}
        while self._swapped and self._swapped[0].seq_id not in swapped_now:
            seq = self._swapped[0]
            need = self._blocks_for(seq.num_tokens + 1)
            idle = not self._running and not self._transferring  # nobody left to grow: no watermark
            if self.pool.num_free_blocks - need < (0 if idle else self.config.watermark_blocks):
                break
            self._swapped.pop(0)
            seq.block_ids = self.pool.allocate(need)
            out.swap_in.append((seq, seq.block_ids[: seq.num_swapped_blocks]))
            self._swap_used -= seq.num_swapped_blocks
            seq.num_swapped_blocks = 0
            seq.status = SeqStatus.RUNNING
            bisect.insort(self._running, seq, key=_fcfs)
        while self._waiting and not self._swapped:
            seq = self._waiting[0]
            live = len(self._running) + len(self._transferring) + len(self._swapped)
            room = self.pool.num_free_blocks - self._group_blocks(seq)
            if live + 1 + len(seq.forks) > self.config.max_num_seqs or room < self.config.watermark_blocks:
                break
            self._waiting.pop(0)
            seq.block_ids = self.pool.allocate(self._blocks_for(seq.num_tokens + 1))
            for fork in [seq, *(self._seqs[f] for f in seq.forks)]:
                if fork is not seq:
                    fork.block_ids, fork.cow = fork_for_append(self.pool, seq.block_ids, seq.num_tokens,
                                                               self.config.share_prompt)
                fork.status = SeqStatus.TRANSFERRING
                self._transferring[fork.seq_id] = fork
            out.admitted.append(seq)
        out.decode = [s for s in self._running if s.seq_id not in stalled]
        return out

    def _grow_running(self, out: SchedulerOutput) -> set[str]:
        """Give each running seq, oldest first, a slot for its next token; return those left without."""
        stalled: set[str] = set()
        for seq in list(self._running):
            if seq.status is not SeqStatus.RUNNING:
                continue  # swapped out earlier in this pass
            need = self._blocks_for(seq.num_tokens + 1) - len(seq.block_ids)
            if need <= 0:
                continue
            if len(seq.block_ids) + need > self.pool.num_blocks:
                self._release(seq)
                out.failed.append(seq)
                continue
            while self.pool.num_free_blocks < need and seq.status is SeqStatus.RUNNING:
                victim = self._pick_victim(seq)
                if victim is None:
                    break
                self._swap_out(victim, out)
            if seq.status is SeqStatus.RUNNING:
                if self.pool.can_allocate(need):
                    seq.block_ids.extend(self.pool.allocate(need))
                else:
                    stalled.add(seq.seq_id)  # nobody fits the swap space: wait a step
        return stalled

    def _pick_victim(self, seq: SeqState) -> SeqState | None:
        """The youngest running seq but ``seq`` that fits the swap space (``seq`` if alone), or None."""
        others = [s for s in reversed(self._running) if s is not seq]
        for cand in others or [seq]:
            if self._swap_used + self._blocks_for(cand.num_tokens) <= self.config.max_swap_blocks:
                return cand
        return None

    def _swap_out(self, seq: SeqState, out: SchedulerOutput) -> None:
        n_data = self._blocks_for(seq.num_tokens)  # a trailing empty slot block is not copied
        out.swap_out.append((seq, seq.block_ids[:n_data]))
        self.pool.free(seq.block_ids)
        seq.block_ids, seq.num_swapped_blocks = [], n_data
        self._swap_used += n_data
        self._running.remove(seq)
        seq.status = SeqStatus.SWAPPED
        bisect.insort(self._swapped, seq, key=_fcfs)

    def _transferring_seq(self, seq_id: str, event: str) -> SeqState | None:
        seq = self._seqs.get(seq_id)  # None: aborted meanwhile, a late report is ignored
        if seq is not None and seq.status is not SeqStatus.TRANSFERRING:
            raise ValueError(f"{seq_id}: transfer {event} while {seq.status.value}")
        return seq

    def on_transfer_done(self, seq_id: str) -> list[tuple[int, int]]:
        """TRANSFERRING → RUNNING, the head's forks with it; returns the copies ``(source, destination)``
        of the head's partial last block the worker must make before the next step (see the module
        docstring). A late report for an aborted (finished) sequence is ignored."""
        seq = self._transferring_seq(seq_id, "done")
        if seq is None:
            return []
        if seq.fork_of is not None:
            raise ValueError(f"{seq_id}: a fork's KV arrives with its head {seq.fork_of}")
        copies: list[tuple[int, int]] = []
        for s in [seq, *(self._seqs[f] for f in seq.forks)]:
            copies += s.cow
            s.fork_of, s.cow = None, []
            del self._transferring[s.seq_id]
            s.status = SeqStatus.RUNNING
            bisect.insort(self._running, s, key=_fcfs)
        seq.forks = []
        return copies

    def on_transfer_failed(self, seq_id: str) -> None:
        """TRANSFERRING → FINISHED (forks too), blocks freed. Ignored for an unknown or finished sequence."""
        seq = self._transferring_seq(seq_id, "failed")
        if seq is not None:
            self._release(seq)

    def on_token(self, seq_id: str) -> None:
        """A decode step wrote this seq's KV at position ``num_tokens``: count it."""
        seq = self._seqs.get(seq_id)
        if seq is None or seq.status is not SeqStatus.RUNNING:
            raise ValueError(f"{seq_id}: token for a sequence that is not running")
        if seq.num_tokens >= len(seq.block_ids) * self.pool.block_size:
            raise ValueError(f"{seq_id}: token written without a slot; call schedule() first")
        seq.num_tokens += 1

    def finish(self, seq_id: str) -> list[str]:
        """Any state → FINISHED, blocks freed, forgotten (abort too); returns the ids finished (with a
        head whose KV is not in yet, its forks too). Idempotent."""
        seq = self._seqs.get(seq_id)
        if seq is None:
            return []
        forks = list(seq.forks)
        self._release(seq)
        return [seq_id, *forks]

    def _release(self, seq: SeqState) -> None:
        for fid in list(seq.forks):  # a head before its KV is in: its forks have nothing to run on
            self._release(self._seqs[fid])
        if seq.fork_of is not None:
            self._seqs[seq.fork_of].forks.remove(seq.seq_id)
            seq.fork_of, seq.cow = None, []
        if seq.status is SeqStatus.WAITING:
            if seq in self._waiting:  # a waiting fork is not queued: its head is
                self._waiting.remove(seq)
        elif seq.status is SeqStatus.TRANSFERRING:
            del self._transferring[seq.seq_id]
        elif seq.status is SeqStatus.RUNNING:
            self._running.remove(seq)
        elif seq.status is SeqStatus.SWAPPED:
            self._swapped.remove(seq)
            self._swap_used -= seq.num_swapped_blocks
            seq.num_swapped_blocks = 0
        self.pool.free(seq.block_ids)
        seq.block_ids, seq.status = [], SeqStatus.FINISHED
        del self._seqs[seq.seq_id]

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_transferring(self) -> int:
        return len(self._transferring)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_swapped(self) -> int:
        return len(self._swapped)

    @property
    def num_swap_blocks_used(self) -> int:
        return self._swap_used

    def has_work(self) -> bool:
        return bool(self._seqs)  # live sequences in any queue

    def get(self, seq_id: str) -> SeqState | None:
        """The live sequence, or None once finished (or never added)."""
        return self._seqs.get(seq_id)

    def check_integrity(self) -> None:
        """Raise AssertionError if the queues, the statuses and the pool's books disagree."""
        xfer = list(self._transferring.values())
        queues = [(SeqStatus.WAITING, self._waiting), (SeqStatus.RUNNING, self._running)]
        queues += [(SeqStatus.SWAPPED, self._swapped), (SeqStatus.TRANSFERRING, xfer)]
        for status, queue in queues:
            assert all(s.status is status for s in queue), f"a seq in the {status.value} queue is not"
            if status is not SeqStatus.TRANSFERRING:
                assert [_fcfs(s) for s in queue] == sorted(map(_fcfs, queue)), f"{status.value} out of order"
        ids = [s.seq_id for _, queue in queues for s in queue]
        ids += [f for s in self._waiting for f in s.forks]  # queued with their head
        assert sorted(ids) == sorted(self._seqs), "a live seq is in no queue, or in two"
        for s in self._seqs.values():
            head = self._seqs.get(s.fork_of) if s.fork_of is not None else None
            assert s.fork_of is None or (head is not None and s.seq_id in head.forks
                                         and s.status is head.status), f"{s.seq_id}: fork without its head"
            assert not s.forks or s.status in (SeqStatus.WAITING, SeqStatus.TRANSFERRING), s.seq_id
            assert len(set(s.block_ids)) == len(s.block_ids), f"{s.seq_id}: a block twice in one table"
        owners = Counter(b for s in self._seqs.values() for b in s.block_ids)
        assert len(owners) == self.pool.num_used_blocks, f"{len(owners)} owned, pool says used"
        for b, k in owners.items():
            refs = self.pool.blocks[b].ref_count
            assert refs == k, f"block {b}: ref_count {refs}, {k} owners"
        for s in self._seqs.values():
            room = len(s.block_ids) * self.pool.block_size
            with_kv = s.status in (SeqStatus.TRANSFERRING, SeqStatus.RUNNING)
            assert room >= s.num_tokens if with_kv else room == 0, f"{s.seq_id}: {room} slots"
            if with_kv and s.num_tokens < room:
                slot = s.block_ids[s.num_tokens // self.pool.block_size]
                assert owners[slot] == 1, f"{s.seq_id}: its next slot is in shared block {slot}"
        swapped = sum(s.num_swapped_blocks for s in self._swapped)
        assert self._swap_used == swapped <= self.config.max_swap_blocks, f"swap space: {swapped} blocks"
        self.pool.check_integrity()
