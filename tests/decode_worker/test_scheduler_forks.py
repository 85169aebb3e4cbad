"""DecodeScheduler with forks (the n choices of one request) without a model: admission reserves for
every choice, forks share the prompt's full blocks and copy a shared partial block, a head ended
before its KV is in takes its forks along, swap and abort of one choice leave the others' blocks
intact; and a seeded simulation on a fake KV cache where every choice reads back the prompt's KV
(written once, into the head) and its own tokens, with aborts of single choices and of whole groups."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from decode_worker.scheduler import DecodeScheduler, SchedulerConfig
from decode_worker.seq_state import SeqStatus
from engine.block_pool import BlockPool
from engine.errors import ContextLengthError
from tests.support.scheduler_kv import FakeKV, step

BS = 4


def make(num_blocks: int = 12, **cfg: int) -> tuple[DecodeScheduler, BlockPool]:
    pool = BlockPool(num_blocks, BS, enable_prefix_cache=False)
    return DecodeScheduler(SchedulerConfig(**cfg), pool), pool


def forks(n: int, head: str = "r") -> list[str]:
    return [f"{head}#{i}" for i in range(1, n)]


def owners(pool: BlockPool) -> dict[int, int]:
    return {b.block_id: b.ref_count for b in pool.blocks if b.ref_count}



def test_admission_reserves_a_block_per_choice() -> None:
    sched, pool = make(7, watermark_blocks=1)
    sched.add("r", 9, 0.0, forks=forks(4))  # 3 blocks for the head's 10 slots, 1 per fork: 6
    sched.add("s", 3, 1.0)
    out = sched.schedule()
    assert [s.seq_id for s in out.admitted] == ["r"]  # s (1 block) would leave 0 < watermark
    assert pool.num_free_blocks == 1 and sched.num_transferring == 4 and sched.num_waiting == 1
    sched.check_integrity()
    with pytest.raises(ContextLengthError, match="in 8 sequences"):
        sched.add("big", 9, 2.0, forks=forks(8, "big"))
    with pytest.raises(ValueError, match="max_num_seqs"):
        make(100, max_num_seqs=3)[0].add("x", 1, 0.0, forks=forks(4, "x"))


def test_max_num_seqs_counts_every_choice() -> None:
    sched, _ = make(100, max_num_seqs=4)
    sched.add("a", 1, 0.0, forks=forks(2, "a"))
    sched.add("b", 1, 1.0, forks=forks(3, "b"))
    assert [s.seq_id for s in sched.schedule().admitted] == ["a"]  # 2 + 3 > 4
    sched.finish("a")  # the head before its KV: the fork goes too
    assert sched.get("a#1") is None
    assert [s.seq_id for s in sched.schedule().admitted] == ["b"]


@pytest.mark.parametrize(("num_tokens", "copies"), [(6, 2), (8, 0)])
def test_transfer_done_runs_the_group_and_returns_the_partial_block_copies(num_tokens: int, copies: int) -> None:
    sched, pool = make()
    head = sched.add("r", num_tokens, 0.0, forks=forks(3))
    sched.schedule()
    fork_seqs = [sched.get(f) for f in forks(3)]
    assert all(f is not None and f.status is SeqStatus.TRANSFERRING for f in fork_seqs)
    full = num_tokens // BS
    assert owners(pool)[head.block_ids[0]] == 3 and full == len([b for b in head.block_ids if owners(pool)[b] == 3])
    got = sched.on_transfer_done("r")
    assert len(got) == copies and all(src == head.block_ids[full] for src, _ in got)
    assert {f.block_ids[full] for f in fork_seqs if f is not None} == {dst for _, dst in got} or not copies
    assert sched.num_running == 3 and sched.num_transferring == 0
    assert step(sched) == ["r", "r#1", "r#2"]  # each writes token 0's KV into a block of its own
    with pytest.raises(ValueError, match="its head"):
        sched.add("q", 3, 1.0, forks=["q#1"])
        sched.schedule()
        sched.on_transfer_done("q#1")


def test_ending_one_choice_keeps_the_shared_blocks_for_the_others() -> None:
    sched, pool = make()
    head = sched.add("r", 9, 0.0, forks=forks(3))
    sched.schedule()
    sched.on_transfer_done("r")
    step(sched)
    shared = head.block_ids[:2]
    sched.finish("r")  # the head finishes first: its blocks stay while a fork names them
    sched.check_integrity()
    assert [owners(pool)[b] for b in shared] == [2, 2]
    for _ in range(4):
        assert step(sched) == ["r#1", "r#2"]
    sched.finish("r#2")
    assert [owners(pool)[b] for b in shared] == [1, 1]
    sched.finish("r#1")
    sched.check_integrity()
    assert pool.num_free_blocks == 12 and not sched.has_work()


def test_swap_out_of_a_fork_drops_only_its_references() -> None:
    sched, pool = make(7, watermark_blocks=0)
    head = sched.add("r", 8, 0.0, forks=forks(2))  # head: 3 blocks, fork: shares 2 + 1 of its own
    sched.schedule()
    sched.on_transfer_done("r")
    shared = head.block_ids[:2]
    sched.add("late", 3, 1.0)
    assert [s.seq_id for s in sched.schedule().admitted] == ["late"]
    sched.on_transfer_done("late")
    while not sched.num_swapped:
        step(sched)
    sched.check_integrity()
    swapped = [sched.get(i) for i in ("r", "r#1", "late")]
    victims = [s for s in swapped if s is not None and s.status is SeqStatus.SWAPPED]
    for s in victims:
        assert s.block_ids == [] and s.num_swapped_blocks >= 2  # the shared blocks' KV went to host too
    live_refs = Counter(b for s in swapped if s is not None for b in s.block_ids)
    assert all(owners(pool)[b] == live_refs[b] for b in shared if b in live_refs)
    while sched.num_swapped:
        sched.finish("late")
        step(sched)
    sched.check_integrity()
    for rid in ("r", "r#1"):
        sched.finish(rid)
    assert pool.num_free_blocks == 7 and not sched.has_work()


def test_without_sharing_each_fork_copies_the_whole_prompt() -> None:
    """``share_prompt`` off (a model whose decode step may rewrite a sequence's whole KV): a fork
    reserves as many blocks as its head and gets a copy of every block with KV; none is shared."""
    sched, pool = make(12, watermark_blocks=0, share_prompt=False)
    head = sched.add("r", 6, 0.0, forks=forks(3))  # 2 blocks each: 6
    sched.add("s", 3, 1.0)
    out = sched.schedule()
    assert [s.seq_id for s in out.admitted] == ["r", "s"] and pool.num_free_blocks == 5
    copies = sched.on_transfer_done("r")
    assert sorted(src for src, _ in copies) == sorted(head.block_ids * 2)
    assert all(ref == 1 for ref in owners(pool).values())
    sched.check_integrity()
    with pytest.raises(ContextLengthError):
        sched.add("big", 16, 2.0, forks=forks(3, "big"))  # 5 blocks x 3 > 12


def test_abort_while_waiting_or_transferring_takes_the_whole_group() -> None:
    sched, pool = make(20)
    sched.add("w", 3, 0.0, forks=forks(3, "w"))
    assert sched.finish("w#1") == ["w#1"]  # a fork alone: dropped from its head
    assert sched.get("w").forks == ["w#2"]  # type: ignore[union-attr]
    sched.check_integrity()
    assert sorted(sched.finish("w")) == ["w", "w#2"]
    sched.add("t", 6, 1.0, forks=forks(3, "t"))
    sched.schedule()
    sched.check_integrity()
    sched.on_transfer_failed("t")
    assert [sched.get(i) for i in ("t", "t#1", "t#2")] == [None, None, None]
    sched.check_integrity()
    assert pool.num_free_blocks == 20 and not sched.has_work()




@pytest.mark.parametrize("seed", range(16))
def test_random_simulation_every_choice_reads_its_own_kv(seed: int) -> None:
    """A fake worker runs each output in protocol order on a fake KV cache (row → (owner, position)):
    a prompt's rows belong to its request, written once into the head's blocks; the copies
    `on_transfer_done` returns are made at once; a choice's own tokens belong to its sequence."""
    rng = random.Random(seed)
    num_blocks, wm = rng.randint(10, 30), rng.randint(0, 2)
    share = rng.random() < 0.75  # off: every fork copies the whole prompt
    cfg = SchedulerConfig(max_num_seqs=rng.randint(4, 10), watermark_blocks=wm, max_swap_blocks=4096,
                          share_prompt=share)
    pool = BlockPool(num_blocks, BS, enable_prefix_cache=False)
    sched = DecodeScheduler(cfg, pool)
    kv = FakeKV(num_blocks, BS)
    pending: dict[str, int] = {}  # heads whose transfer is in flight: steps left
    prompt_of: dict[str, tuple[str, int]] = {}  # seq → (request, prompt length)
    max_new = min(24, (num_blocks - wm) * BS // 4)
    todo: dict[str, int] = {}
    arrivals = sorted((rng.randint(0, 100), f"q{i}") for i in range(24))
    done: set[str] = set()
    abort_rate = rng.choice([0.0, 0.03])

    def end(sid: str) -> None:
        for f in sched.finish(sid):  # a head before its KV: its forks end with it
            pending.pop(f, None)  # the worker lets a transfer finish before it ends the group
            kv.host.pop(f, None)
            done.add(f)

    stats = Counter[str]()
    for it in range(4000):
        while arrivals and arrivals[0][0] <= it:
            rid = arrivals.pop(0)[1]
            n = rng.randint(1, 4)
            group = [rid, *forks(n, rid)]
            room = (num_blocks - wm) - n - 1 if share else (num_blocks - wm) // n  # blocks for the prompt
            prompt = rng.randint(1, max(1, min(room * BS - 1, 30)))
            sched.add(rid, prompt, float(it), forks=group[1:])
            for sid in group:
                prompt_of[sid] = (rid, prompt)
                todo[sid] = rng.randint(1, max_new)
        live = [s for s in todo if s not in done and sched.get(s) is not None]
        if live and rng.random() < abort_rate:
            victim = rng.choice(live)  # one choice, or (its head) a whole group not yet running
            victim = rng.choice([victim, prompt_of[victim][0]])
            if prompt_of[victim][0] not in pending:  # the worker lets a transfer in flight finish first
                end(victim)
        out = sched.schedule()
        sched.check_integrity()
        assert out.failed == []
        stats["swap_out"] += len(out.swap_out)
        kv.swaps(out)
        for seq in out.admitted:
            pending[seq.seq_id] = rng.randint(0, 3)
        for rid in list(pending):
            pending[rid] -= 1
            if pending[rid] >= 0:
                continue
            del pending[rid]
            head = sched.get(rid)
            assert head is not None
            if rng.random() < 0.05:
                members = [rid, *head.forks]
                sched.on_transfer_failed(rid)
                done.update(members)
                continue
            for p in range(head.num_tokens):
                kv.write(head, p)
            for src, dst in sched.on_transfer_done(rid):
                stats["copies"] += 1
                kv.copy(src, dst)
        for seq in out.decode:
            rid, plen = prompt_of[seq.seq_id]
            assert kv.read(seq) == [(rid, p) if p < plen else (seq.seq_id, p) for p in range(seq.num_tokens)]
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
    assert stats["swap_out"] and stats["copies"]  # the run did preempt and copy-on-write
