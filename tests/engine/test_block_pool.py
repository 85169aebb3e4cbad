"""BlockPool: a hypothesis state machine against a model of ref counts and block contents (the tokens
and the chain's salt), plus unit tests for every error and for the eviction order. Runs with the
real hash and with every hash forced to one constant (a collision on every lookup), where
verification must reject wrong hits."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from hypothesis.stateful import run_state_machine_as_test as run_machine

import engine.block_pool as bp
from engine.block_pool import BlockPool, block_hashes, hash_block
from engine.errors import NoFreeBlocksError

BS = 2
# Few distinct tokens and shared stems, so prefixes (and same-tokens-after-other-prefix) recur.
stems = st.sampled_from([[], [1, 2], [1, 2, 3, 4], [3, 4], [2, 1, 1]])
prompts = st.builds(lambda a, b: a + b, stems, st.lists(st.integers(0, 4), max_size=6)).filter(bool)


class Seq:
    def __init__(self, tokens: list[int], blocks: list[int], salt: int = 0) -> None:
        self.tokens, self.blocks, self.salt = tokens, blocks, salt


class PoolMachine(RuleBasedStateMachine):
    """Model: ``refs`` (block → ref count) and ``content`` (block → the salt and the token prefix its
    KV encodes: a salt stands for what else the KV depends on, e.g. a length-dependent RoPE's table)."""

    collisions = False

    @initialize(num_blocks=st.integers(1, 12), cache=st.booleans())
    def setup(self, num_blocks: int, cache: bool) -> None:
        self.pool = BlockPool(num_blocks, BS, enable_prefix_cache=cache)
        self.seqs: list[Seq] = []
        self.refs: dict[int, int] = {}
        self.content: dict[int, tuple[int, tuple[int, ...]]] = {}

    def _write(self, seq: Seq, start_block: int) -> None:
        for i in range(start_block, len(seq.blocks)):
            self.content[seq.blocks[i]] = (seq.salt, tuple(seq.tokens[: (i + 1) * BS]))

    def _ref(self, blocks: list[int], delta: int) -> None:
        for b in blocks:
            self.refs[b] = self.refs.get(b, 0) + delta
            if self.refs[b] == 0:
                del self.refs[b]

    @rule(tokens=prompts, salt=st.sampled_from([0, 0, 1, 40]))
    def new_seq(self, tokens: list[int], salt: int) -> None:
        hit = self.pool.match_prefix(tokens[:-1], salt)
        for i, b in enumerate(hit):  # a hit must hold exactly this prompt's prefix, under its salt
            assert self.content.get(b) == (salt, tuple(tokens[: (i + 1) * BS])), (b, tokens, self.content.get(b))
        if not self.pool.enable_prefix_cache:
            assert hit == []
        self._ref(hit, +1)
        need = -(-len(tokens) // BS) - len(hit)
        try:
            fresh = self.pool.allocate(need)
        except NoFreeBlocksError:
            assert need > self.pool.num_free_blocks
            self.pool.free(hit)
            self._ref(hit, -1)
            return
        self._ref(fresh, +1)
        seq = Seq(tokens, hit + fresh, salt)
        self._write(seq, len(hit))
        self.seqs.append(seq)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def commit(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(self.seqs))
        self.pool.commit_full_blocks(seq.blocks, seq.tokens, seq.salt)
        if self.pool.enable_prefix_cache and not self.collisions:
            hit = self.pool.match_prefix(seq.tokens, seq.salt)  # everything just committed is findable
            assert len(hit) == len(seq.tokens) // BS
            self.pool.free(hit)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), extra=st.lists(st.integers(0, 4), min_size=1, max_size=4))
    def grow(self, data: st.DataObject, extra: list[int]) -> None:
        seq = data.draw(st.sampled_from(self.seqs))
        if len(seq.tokens) % BS and self.refs[seq.blocks[-1]] > 1:
            return  # appending into a shared partial block would need copy-on-write
        need = -(-(len(seq.tokens) + len(extra)) // BS) - len(seq.blocks)
        if not self.pool.can_allocate(need):
            return
        first_written = len(seq.tokens) // BS
        fresh = self.pool.allocate(need)
        self._ref(fresh, +1)
        seq.tokens, seq.blocks = seq.tokens + extra, seq.blocks + fresh
        self._write(seq, first_written)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(self.seqs))
        self.pool.fork(seq.blocks)
        self._ref(seq.blocks, +1)
        self.seqs.append(Seq(list(seq.tokens), list(seq.blocks), seq.salt))

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free_seq(self, data: st.DataObject) -> None:
        seq = self.seqs.pop(data.draw(st.integers(0, len(self.seqs) - 1)))
        self.pool.free(seq.blocks)
        self._ref(seq.blocks, -1)

    @rule(data=st.data())
    def double_free_rejected(self, data: st.DataObject) -> None:
        unreferenced = [b for b in range(self.pool.num_blocks) if b not in self.refs]
        bad = data.draw(st.sampled_from([*unreferenced, -1, self.pool.num_blocks]))
        good = [self.seqs[0].blocks[0]] if self.seqs else []
        before = [b.ref_count for b in self.pool.blocks]
        with pytest.raises(ValueError):
            self.pool.free([*good, bad])
        assert [b.ref_count for b in self.pool.blocks] == before  # validated before anything changed

    @rule()
    def evict_everything(self) -> None:
        n = self.pool.num_free_blocks
        with pytest.raises(NoFreeBlocksError):
            self.pool.allocate(n + 1)
        hog = self.pool.allocate(n)  # empties the free list, then evicts every cached block
        assert all(self.pool.blocks[b].hash is None for b in hog)
        for b in hog:
            self.content.pop(b, None)  # garbage now; a later hit on it would be caught
        self.pool.free(hog)

    @invariant()
    def books_agree(self) -> None:
        self.pool.check_integrity()
        assert {b.block_id: b.ref_count for b in self.pool.blocks if b.ref_count} == self.refs
        assert self.pool.num_used_blocks == len(self.refs)
        assert self.pool.num_free_blocks == self.pool.num_blocks - len(self.refs)

    def teardown(self) -> None:
        if not hasattr(self, "pool"):
            return
        for seq in self.seqs:
            self.pool.free(seq.blocks)
        self.pool.check_integrity()
        assert self.pool.num_free_blocks == self.pool.num_blocks and self.pool.num_used_blocks == 0


FAST = settings(max_examples=60, stateful_step_count=30, deadline=None, suppress_health_check=list(HealthCheck))


def test_pool_state_machine() -> None:
    run_machine(PoolMachine, settings=FAST)


class CollidingPoolMachine(PoolMachine):
    collisions = True


def test_pool_state_machine_every_hash_collides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bp, "hash_block", lambda parent, tokens: 7)
    run_machine(CollidingPoolMachine, settings=FAST)


def test_hashes_are_a_stable_chain() -> None:
    # Pinned: the router and other processes must compute the same keys.
    assert hash_block(0, (1, 2)) == 8901564848246840783
    assert block_hashes([1, 2, 3, 4, 5], 2) == [8901564848246840783, 5144891096145841010]
    assert block_hashes([9, 9, 3, 4], 2)[1] != block_hashes([1, 2, 3, 4], 2)[1]  # parent is in the key
    assert block_hashes([1], 2) == []


def test_allocate_errors_change_nothing() -> None:
    pool = BlockPool(4, 2)
    pool.allocate(1)
    with pytest.raises(NoFreeBlocksError, match="asked for 4, 3 free"):
        pool.allocate(4)
    with pytest.raises(ValueError):
        pool.allocate(-1)
    assert pool.num_free_blocks == 3 and pool.can_allocate(3) and not pool.can_allocate(4)
    pool.check_integrity()


def test_free_rejects_double_free_and_bad_ids_atomically() -> None:
    pool = BlockPool(4, 2)
    a, b = pool.allocate(2)
    with pytest.raises(ValueError, match="double free"):
        pool.free([a, b, b])
    with pytest.raises(ValueError, match="out of range"):
        pool.free([a, 4])
    assert pool.blocks[a].ref_count == pool.blocks[b].ref_count == 1
    pool.free([a, b])
    with pytest.raises(ValueError, match="double free"):
        pool.free([a])
    assert pool.num_free_blocks == 4


def test_fork_and_commit_errors() -> None:
    pool = BlockPool(4, 2)
    with pytest.raises(ValueError, match="unreferenced"):
        pool.fork([0])
    blocks = pool.allocate(2)
    with pytest.raises(ValueError, match="full blocks"):
        pool.commit_full_blocks(blocks[:1], [1, 2, 3, 4])
    with pytest.raises(ValueError, match="repeated"):
        pool.commit_full_blocks([blocks[0], blocks[0]], [1, 2, 3, 4])
    with pytest.raises(ValueError, match="unreferenced"):
        pool.commit_full_blocks([3], [1, 2])
    pool.commit_full_blocks(blocks, [1, 2, 3, 4])
    with pytest.raises(ValueError, match="other contents"):
        pool.commit_full_blocks(blocks, [1, 2, 3, 5])
    pool.check_integrity()


def test_prefix_hit_shares_blocks_and_keeps_one_token_to_compute() -> None:
    pool = BlockPool(8, 2)
    prompt = [1, 2, 3, 4]
    blocks = pool.allocate(2)
    pool.commit_full_blocks(blocks, prompt)
    assert pool.match_prefix(prompt[:-1]) == blocks[:1]  # block-aligned prompt: last block recomputed
    assert pool.blocks[blocks[0]].ref_count == 2
    pool.free(blocks)
    assert pool.num_free_blocks == 7  # one still referenced by the hit; the other cached, evictable
    assert pool.match_prefix([1, 2, 3, 4, 5]) == blocks  # revived from the cached set
    assert pool.match_prefix([1, 9, 3, 4]) == []


def test_eviction_is_lru_and_tail_first() -> None:
    pool = BlockPool(4, 2)
    a = pool.allocate(3)
    pool.commit_full_blocks(a, [1, 2, 3, 4, 5, 6])
    b = pool.allocate(1)
    pool.commit_full_blocks(b, [7, 8])
    pool.free(a)  # cached in order a[2], a[1], a[0]: the tail goes first
    pool.free(b)
    assert pool.allocate(1) == [a[2]]
    assert pool.match_prefix([1, 2, 3, 4, 5, 6]) == a[:2]
    assert pool.match_prefix([7, 8]) == b
    pool.check_integrity()


def test_duplicate_stays_unfindable_but_chain_continues() -> None:
    pool = BlockPool(8, 2)
    x = pool.allocate(1)
    pool.commit_full_blocks(x, [1, 2])
    y = pool.allocate(2)  # computed [1, 2] again (missed the cache), then [3, 4]
    pool.commit_full_blocks(y, [1, 2, 3, 4])
    assert pool.blocks[y[0]].hash is None
    assert pool.match_prefix([1, 2, 3, 4]) == [x[0], y[1]]
    pool.free([x[0], y[1]])
    pool.free(y)
    assert pool.num_free_blocks == 7
    pool.check_integrity()


def test_collisions_never_return_wrong_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bp, "hash_block", lambda parent, tokens: 7)
    pool = BlockPool(8, 2)
    x = pool.allocate(2)
    pool.commit_full_blocks(x, [1, 2, 3, 4])  # only x[0] is registered: x[1] collides with it
    assert pool.match_prefix([5, 6]) == []  # same hash, other tokens
    y = pool.allocate(2)
    pool.commit_full_blocks(y, [3, 4, 1, 2])
    assert pool.match_prefix([3, 4]) == []  # same hash, x[0] holds other tokens
    assert pool.match_prefix([1, 2, 1, 2]) == [x[0]]  # x[0] is a first block, never a second one
    pool.free([x[0]])


@pytest.mark.parametrize("collide", [False, True])
def test_salted_chains_never_share_blocks(monkeypatch: pytest.MonkeyPatch, collide: bool) -> None:
    """The same tokens under another salt (a prompt whose RoPE table differs) are a miss, even where
    every hash collides; salt 0 is the unsalted chain the router's `block_hashes` computes."""
    if collide:
        monkeypatch.setattr(bp, "hash_block", lambda parent, tokens: 7)
    pool = BlockPool(8, 2)
    short, long = pool.allocate(2), pool.allocate(2)
    pool.commit_full_blocks(short, [1, 2, 3, 4])
    pool.commit_full_blocks(long, [1, 2, 3, 4], salt=1)
    assert pool.match_prefix([1, 2, 3, 4], salt=2) == []
    assert pool.match_prefix([1, 2, 3, 4], salt=0) == ([short[0]] if collide else short)
    assert pool.match_prefix([1, 2, 3, 4], salt=1) == ([] if collide else long)  # collide: short[0] holds the hash
    if not collide:
        assert [pool.blocks[b].hash for b in short] == block_hashes([1, 2, 3, 4], 2)
    pool.free(short + long)  # the allocations
    pool.free([short[0]] if collide else short + long)  # the hits
    pool.check_integrity()


def test_reused_parent_invalidates_its_children() -> None:
    pool = BlockPool(2, 2)
    a = pool.allocate(2)
    pool.commit_full_blocks(a, [1, 2, 3, 4])
    pool.free([a[0]])  # parent cached and then evicted; the child stays in use, still hashed
    fresh = pool.allocate(1)
    pool.commit_full_blocks(fresh, [1, 2])  # the same tokens again, but another registration
    assert pool.match_prefix([1, 2, 3, 4]) == fresh  # a[1]'s recorded parent is gone: no hit on it
    pool.free(fresh + fresh + a[1:])
    pool.check_integrity()


def test_cache_off_and_reset() -> None:
    off = BlockPool(4, 2, enable_prefix_cache=False)
    blocks = off.allocate(2)
    off.commit_full_blocks(blocks, [1, 2, 3, 4])
    assert off.match_prefix([1, 2, 3, 4]) == []
    pool = BlockPool(4, 2)
    blocks = pool.allocate(2)
    pool.commit_full_blocks(blocks, [1, 2, 3, 4])
    pool.free(blocks[1:])
    pool.reset_prefix_cache()
    pool.check_integrity()
    assert pool.match_prefix([1, 2, 3, 4]) == [] and pool.num_free_blocks == 3


def test_check_integrity_catches_bad_books() -> None:
    pool = BlockPool(4, 2)
    pool.blocks[0].ref_count = 1  # referenced, yet on the free list
    with pytest.raises(AssertionError, match="block 0"):
        pool.check_integrity()
