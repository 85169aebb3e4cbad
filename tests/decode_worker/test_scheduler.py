"""DecodeScheduler without a model: admission, FCFS, growth at block boundaries, swap preemption and
resume, finish/abort; and a seeded simulation of a worker that executes every SchedulerOutput on a
fake KV cache, checking that each sequence reads back exactly the KV it wrote."""

from __future__ import annotations

import random

import pytest

from decode_worker.scheduler import DecodeScheduler, SchedulerConfig
from decode_worker.seq_state import SeqState, SeqStatus
from engine.block_pool import BlockPool
from engine.errors import ContextLengthError
from tests.support.scheduler_kv import FakeKV, step

BS = 4


def make(num_blocks: int = 10, **cfg: int) -> tuple[DecodeScheduler, BlockPool]:
    pool = BlockPool(num_blocks, BS, enable_prefix_cache=False)
    return DecodeScheduler(SchedulerConfig(**cfg), pool), pool


def start(sched: DecodeScheduler, *specs: tuple[str, int]) -> list[SeqState]:
    """Add, admit and finish the transfer of each (id, num_tokens): all end up RUNNING."""
    seqs = [sched.add(rid, n, float(i)) for i, (rid, n) in enumerate(specs)]
    out = sched.schedule()
    assert out.admitted == seqs
    for s in seqs:
        sched.on_transfer_done(s.seq_id)
    return seqs



def test_admission_by_free_blocks_and_watermark() -> None:
    sched, pool = make(10, watermark_blocks=1)
    for i, n in enumerate([15, 15, 7]):  # need 4, 4, 2 blocks (room for num_tokens + 1)
        sched.add(f"r{i}", n, float(i))
    out = sched.schedule()
    assert [s.seq_id for s in out.admitted] == ["r0", "r1"]  # r2 would leave 0 < watermark free
    assert [len(s.block_ids) for s in out.admitted] == [4, 4]
    assert sched.num_transferring == 2 and sched.num_waiting == 1 and pool.num_free_blocks == 2
    sched.finish("r0")
    assert [s.seq_id for s in sched.schedule().admitted] == ["r2"]


def test_max_num_seqs_caps_live_sequences() -> None:
    sched, _ = make(100, max_num_seqs=2)
    for i in range(3):
        sched.add(f"r{i}", 1, float(i))
    assert len(sched.schedule().admitted) == 2
    sched.on_transfer_done("r0")
    assert sched.schedule().admitted == []  # running + transferring count alike
    sched.finish("r1")
    assert [s.seq_id for s in sched.schedule().admitted] == ["r2"]


def test_fcfs_head_of_line_is_not_overtaken_and_arrival_orders() -> None:
    sched, _ = make(10)
    sched.add("small-late", 1, arrival=5.0)
    sched.add("tie-a", 1, arrival=3.0)
    sched.add("big", 35, arrival=2.0)  # 9 blocks: fits only an empty pool (watermark 1)
    sched.add("tie-b", 1, arrival=3.0)
    sched.add("hog", 3, arrival=1.0)
    sched.add("hog2", 3, arrival=1.5)
    out = sched.schedule()
    assert [s.seq_id for s in out.admitted] == ["hog", "hog2"]  # arrival order, not add order
    sched.finish("hog")
    assert sched.schedule().admitted == []  # big does not fit yet, and nobody behind it passes
    sched.finish("hog2")
    assert [s.seq_id for s in sched.schedule().admitted] == ["big"]
    sched.finish("big")
    assert [s.seq_id for s in sched.schedule().admitted] == ["tie-a", "tie-b", "small-late"]


def test_transfer_done_failed_and_late_reports() -> None:
    sched, pool = make(10)
    a, b = sched.add("a", 3, 0.0), sched.add("b", 3, 1.0)
    sched.schedule()
    with pytest.raises(ValueError):
        sched.on_token("a")  # not running yet
    sched.on_transfer_done("a")
    assert a.status is SeqStatus.RUNNING and sched.num_running == 1
    with pytest.raises(ValueError):
        sched.on_transfer_done("a")  # already running
    sched.on_transfer_failed("b")
    assert b.status is SeqStatus.FINISHED and sched.get("b") is None and b.block_ids == []
    sched.on_transfer_done("b")  # late report for a finished request: ignored
    sched.on_transfer_failed("b")
    assert step(sched) == ["a"]
    sched.finish("a")
    assert pool.num_free_blocks == 10 and not sched.has_work()


def test_growth_allocates_exactly_at_block_boundaries() -> None:
    sched, pool = make(10)
    (seq,) = start(sched, ("a", 2))
    for _ in range(20):
        before = len(seq.block_ids)
        needs_block = seq.num_tokens % BS == 0  # the token about to be written opens a block
        assert step(sched) == ["a"]
        assert len(seq.block_ids) == before + needs_block == -(-seq.num_tokens // BS)
    assert pool.num_used_blocks == len(seq.block_ids)


def test_preemption_swaps_out_the_youngest_first() -> None:
    sched, pool = make(6, watermark_blocks=0)
    old, mid, young = start(sched, ("old", 11), ("mid", 3), ("young", 3))  # 3 + 1 + 1 blocks, 1 free
    young_blocks = list(young.block_ids)
    sched.on_token("old")  # old needs a 4th block: takes the free one
    sched.on_token("mid")  # mid needs a 2nd: none free, the youngest goes
    out = sched.schedule()
    assert [(s.seq_id, ids) for s, ids in out.swap_out] == [("young", young_blocks)]
    assert young.status is SeqStatus.SWAPPED and young.block_ids == [] and young.num_swapped_blocks == 1
    assert out.decode == [old, mid] and len(old.block_ids) == 4 and len(mid.block_ids) == 2
    assert sched.num_swap_blocks_used == 1 and pool.num_free_blocks == 0
    sched.check_integrity()


def test_the_needy_youngest_takes_the_next_youngest_and_alone_swaps_itself() -> None:
    sched, _ = make(4, watermark_blocks=0)
    a, b = start(sched, ("a", 3), ("b", 7))  # 1 + 2 blocks, 1 free
    sched.add("c", 1, 9.0)
    assert [s.seq_id for s in sched.schedule().admitted] == ["c"]  # takes the last block
    sched.on_token("b")  # b, the youngest running, needs a block: a goes, never b itself
    out = sched.schedule()
    assert [s for s, _ in out.swap_out] == [a] and out.decode == [b]
    sched.on_token("b")
    for _ in range(3):
        assert step(sched) == ["b"]
    out = sched.schedule()  # b needs a 4th block, runs alone, c holds the rest: b swaps itself out
    assert [(s, len(ids)) for s, ids in out.swap_out] == [(b, 3)]
    assert [s for s, _ in out.swap_in] == [a] and out.decode == [a]  # the older swapped one resumes
    sched.check_integrity()


def test_swapped_resume_before_waiting_and_copy_protocol() -> None:
    sched, pool = make(5, watermark_blocks=0)
    old, young = start(sched, ("old", 4), ("young", 8))  # 2 + 3 blocks (young's 3rd: empty slot)
    sched.add("w", 1, 5.0)
    for _ in range(4):
        sched.on_token("old")  # old needs a 3rd block: none free
    out = sched.schedule()
    assert [(s, len(ids)) for s, ids in out.swap_out] == [(young, 2)]  # the empty slot is not copied
    assert out.decode == [old] and pool.num_free_blocks == 2
    assert out.admitted == []  # w would fit, but a swapped sequence comes first
    sched.finish("old")
    out = sched.schedule()
    ((seq, copy_into),) = out.swap_in
    assert seq is young and len(copy_into) == 2 and young.block_ids[:2] == copy_into
    assert len(young.block_ids) == 3  # plus a fresh slot for its 9th token
    assert [s.seq_id for s in out.admitted] == ["w"] and out.decode == [young]
    sched.finish("young")
    sched.finish("w")
    sched.finish("w")  # idempotent
    assert pool.num_free_blocks == 5 and not sched.has_work()


def test_full_swap_space_stalls_instead_of_swapping() -> None:
    sched, _ = make(3, watermark_blocks=0, max_swap_blocks=0)
    _, b = start(sched, ("a", 3), ("b", 7))
    sched.on_token("a")
    out = sched.schedule()
    assert out.swap_out == [] and out.decode == [b]  # a waits a step
    sched.finish("b")
    assert step(sched) == ["a"]


def test_deadlock_on_full_swap_space_ends_the_youngest() -> None:
    sched, _ = make(2, watermark_blocks=0, max_swap_blocks=0)
    a, b = start(sched, ("a", 3), ("b", 3))
    sched.on_token("a")
    sched.on_token("b")  # both need a 2nd block; none free, nothing can be swapped, no transfer
    out = sched.schedule()
    assert out.failed == [b] and b.status is SeqStatus.FINISHED and out.decode == [a]
    sched.check_integrity()


def test_outgrowing_the_whole_pool_fails_the_sequence() -> None:
    sched, pool = make(2, watermark_blocks=0)
    (seq,) = start(sched, ("a", 7))
    sched.on_token("a")
    out = sched.schedule()
    assert out.failed == [seq] and seq.status is SeqStatus.FINISHED and pool.num_free_blocks == 2


def test_add_and_token_errors() -> None:
    sched, _ = make(4, watermark_blocks=1)
    with pytest.raises(ValueError):
        sched.add("a", 0, 0.0)
    with pytest.raises(ContextLengthError, match="need 4 blocks"):
        sched.add("a", 12, 0.0)
    start(sched, ("a", 3))
    with pytest.raises(ValueError, match="already"):
        sched.add("a", 1, 0.0)
    sched.on_token("a")
    with pytest.raises(ValueError, match="without a slot"):
        sched.on_token("a")


def test_finish_from_every_state_frees_everything() -> None:
    sched, pool = make(5, watermark_blocks=0)
    start(sched, ("run", 3), ("swap", 7))
    sched.add("xfer", 3, 2.0)
    sched.schedule()
    sched.add("wait", 15, 3.0)
    while not sched.num_swapped:
        step(sched)
    live = ("run", "swap", "xfer", "wait")
    assert {sched.get(r).status for r in live} == set(SeqStatus) - {SeqStatus.FINISHED}  # type: ignore[union-attr]
    for rid in (*live, "never-added"):
        sched.finish(rid)
        sched.check_integrity()
    assert pool.num_free_blocks == 5 and not sched.has_work() and sched.num_swap_blocks_used == 0




@pytest.mark.parametrize("seed", range(16))
def test_random_simulation_everyone_finishes_with_correct_kv(seed: int) -> None:
    """A fake worker runs each output in protocol order on a fake KV cache (row → (request, position))."""
    rng = random.Random(seed)
    num_blocks, wm = rng.randint(6, 24), rng.randint(0, 2)
    swap = rng.choice([4096, num_blocks])
    cfg = SchedulerConfig(max_num_seqs=rng.randint(1, 8), watermark_blocks=wm, max_swap_blocks=swap)
    pool = BlockPool(num_blocks, BS, enable_prefix_cache=False)
    sched = DecodeScheduler(cfg, pool)
    kv = FakeKV(num_blocks, BS)
    pending: dict[str, int] = {}  # transfers in flight: steps left
    max_new = min(40, (num_blocks - wm) * BS - 2)
    max_prompt = (num_blocks - wm) * BS - max_new - 1  # so any sequence fits the pool alone
    arrivals = sorted((rng.randint(0, 150), f"r{i}") for i in range(40))
    todo = {rid: rng.randint(1, max_new) for _, rid in arrivals}  # tokens left to decode
    done: set[str] = set()
    abort_rate = rng.choice([0.0, 0.03])  # without aborts, only the scheduler can unblock itself

    def end(rid: str) -> None:
        pending.pop(rid, None)  # the worker cancels a transfer before it aborts
        kv.host.pop(rid, None)
        sched.finish(rid)
        done.add(rid)

    for it in range(3000):
        while arrivals and arrivals[0][0] <= it:
            sched.add(arrivals.pop(0)[1], rng.randint(1, min(max_prompt, rng.choice([max_prompt, 8]))), float(it))
        live = [r for r in todo if r not in done and sched.get(r) is not None]
        if live and rng.random() < abort_rate:
            end(rng.choice(live))  # the client goes away, whatever state the request is in
        out = sched.schedule()
        sched.check_integrity()
        assert out.failed == [] or swap == num_blocks  # only a too small swap space ends sequences
        for seq in out.failed:
            end(seq.seq_id)
        kv.swaps(out)  # (a), (b)
        for seq in out.admitted:  # (c) started now, lands some steps later
            pending[seq.seq_id] = rng.randint(0, 3)
        for rid in list(pending):
            pending[rid] -= 1
            if pending[rid] >= 0:
                continue
            del pending[rid]
            if rng.random() < 0.05:
                sched.on_transfer_failed(rid)
                done.add(rid)
                continue
            landed = sched.get(rid)
            assert landed is not None
            for p in range(landed.num_tokens):
                kv.write(landed, p)
            sched.on_transfer_done(rid)
        for seq in out.decode:  # (d) every row read back is this sequence's own
            assert kv.read(seq) == [(seq.seq_id, p) for p in range(seq.num_tokens)]
            kv.write(seq, seq.num_tokens)
            sched.on_token(seq.seq_id)
            todo[seq.seq_id] -= 1
            if todo[seq.seq_id] == 0:
                end(seq.seq_id)
        if not arrivals and done == todo.keys():
            break
    else:
        pytest.fail(f"stuck: {sched.num_waiting=} {sched.num_transferring=} {sched.num_running=} {sched.num_swapped=}")
    assert pool.num_free_blocks == num_blocks and not sched.has_work() and not kv.host
