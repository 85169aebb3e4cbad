"""Forking a sequence's blocks: shared full blocks by reference count, copy-on-write of a shared
partial block, and every block back on the free list exactly once when all the forks are freed, in
any order; against a model of who holds which block."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from engine.block_pool import BlockPool, fork_for_append
from engine.errors import NoFreeBlocksError

BS = 4


def refs(pool: BlockPool) -> dict[int, int]:
    return {b.block_id: b.ref_count for b in pool.blocks if b.ref_count}


def test_copy_on_write_copies_only_a_shared_block() -> None:
    pool = BlockPool(6, BS)
    head = pool.allocate(2)
    assert pool.copy_on_write(head, 5) == (head, None)  # not shared: written in place
    pool.fork(head)
    table, copy = pool.copy_on_write(head, 5)
    assert copy is not None and copy[0] == head[1] and table == [head[0], copy[1]]
    assert refs(pool) == {head[0]: 2, head[1]: 1, copy[1]: 1}
    with pytest.raises(ValueError, match="outside"):
        pool.copy_on_write(head, 8)
    pool.check_integrity()


def test_copy_on_write_without_a_free_block_changes_nothing() -> None:
    pool = BlockPool(2, BS)
    head = pool.allocate(2)
    pool.fork(head)
    before = refs(pool)
    with pytest.raises(NoFreeBlocksError):
        pool.copy_on_write(head, 0)
    assert refs(pool) == before
    pool.check_integrity()


@pytest.mark.parametrize(("num_tokens", "copied"), [(6, True), (8, False), (1, True), (4, False)])
def test_fork_shares_full_blocks_and_owns_its_next_slot(num_tokens: int, copied: bool) -> None:
    pool = BlockPool(8, BS)
    head = pool.allocate(-(-(num_tokens + 1) // BS))  # the head's slots for num_tokens + 1, as the scheduler takes
    free = pool.num_free_blocks
    fork, copies = fork_for_append(pool, head, num_tokens)
    assert pool.num_free_blocks == free - 1  # exactly one block of its own
    full = num_tokens // BS
    assert fork[:full] == head[:full] and len(fork) == full + 1
    assert fork[full] not in head and pool.blocks[fork[full]].ref_count == 1
    assert all(pool.blocks[b].ref_count == 2 for b in head[:full])
    assert pool.blocks[head[-1]].ref_count == 1  # the head's own slot stays its own
    assert copies == ([(head[full], fork[full])] if copied else [])
    pool.check_integrity()


@pytest.mark.parametrize("num_tokens", [6, 8])
def test_a_fork_that_does_not_share_copies_every_block(num_tokens: int) -> None:
    slots = -(-(num_tokens + 1) // BS)
    pool = BlockPool(2 * slots + 1, BS)
    head = pool.allocate(slots)
    fork, copies = fork_for_append(pool, head, num_tokens, share=False)
    assert len(fork) == len(head) and not set(fork) & set(head)  # nothing shared
    assert copies == list(zip(head[: -(-num_tokens // BS)], fork, strict=False))  # every block with KV
    assert all(pool.blocks[b].ref_count == 1 for b in head + fork)
    with pytest.raises(NoFreeBlocksError):
        fork_for_append(pool, head, num_tokens, share=False)  # one block free: too few
    pool.check_integrity()


def test_fork_errors_change_nothing() -> None:
    pool = BlockPool(2, BS)
    head = pool.allocate(2)
    with pytest.raises(NoFreeBlocksError):
        fork_for_append(pool, head, 5)
    with pytest.raises(ValueError, match="cannot hold"):
        fork_for_append(pool, head[:1], 5)
    assert refs(pool) == {head[0]: 1, head[1]: 1}


@pytest.mark.parametrize("seed", range(20))
def test_any_free_order_frees_every_block_once(seed: int) -> None:
    """A head and its forks, then some forks of forks mid-generation; freed in a random order, one
    at a time: the ref counts always equal the tables naming each block, and the pool ends empty."""
    rng = random.Random(seed)
    pool = BlockPool(64, BS)
    num_tokens = rng.randint(1, 20)
    tables = {"head": pool.allocate(-(-(num_tokens + 1) // BS))}
    for i in range(rng.randint(1, 5)):
        src = rng.choice(sorted(tables))
        tables[f"f{i}"], _ = fork_for_append(pool, tables[src], num_tokens)

    def check() -> None:
        owners = Counter(b for t in tables.values() for b in t)
        assert refs(pool) == dict(owners)
        pool.check_integrity()

    check()
    for name in rng.sample(sorted(tables), len(tables)):
        pool.free(tables.pop(name))
        check()
    assert pool.num_free_blocks == 64
