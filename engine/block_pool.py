"""Paged-KV block accounting with prefix caching (the CPU books; the tensors are `engine.kv_cache`).

Owns: which KV blocks are free, which are referenced by sequences (and how many times), and
which unreferenced blocks still hold a reusable prefix and can be found by `match_prefix`.

Invariants (checked by `BlockPool.check_integrity`):
- every block is in exactly one of: the free list (ref_count 0, no hash), the cached set
  (ref_count 0, hash registered: evictable, least recently freed first) or referenced (ref_count > 0);
- a block has a hash iff the hash map points that hash at it; a duplicate of a cached block is
  simply not registered;
- ``num_free_blocks`` = free list + cached set: both can be handed out by `allocate`, which takes
  the plain free list first and evicts cached blocks (LRU) only when it is empty.

Sharing: `fork` adds a reference to blocks another sequence holds (the n choices of one prompt
share the prompt's KV). A block with ref_count > 1 is read-only: a sequence about to write into
one takes its own copy first (`copy_on_write`; `fork_for_append` forks a sequence and gives it its
own slot for the next token), so freeing a sequence only ever drops its own references.

Prefix hits are verified, never trusted: the block found for a hash must hold the same tokens, its
recorded parent must be the very block matched just before it, and its chain's salt the one asked
for. The salt says what besides the tokens a block's KV depends on (`ModelConfig.rope_table_key`: a
length-dependent RoPE rotates a prompt by its whole length's table), so chains of different salts
never share a block. Each registration gets a fresh
serial number, so a parent that was evicted and reused does not match its old children. A hash collision costs
a cache miss, never a wrong block. Every operation is O(1) per block named; only
`check_integrity` and `reset_prefix_cache` scan the pool.
"""

from __future__ import annotations

import hashlib
import struct
from collections import Counter, OrderedDict, deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from engine.errors import NoFreeBlocksError

ROOT_HASH = 0  # parent hash of a sequence's first block
_ROOT_SERIAL = 0  # parent serial of a registered first block; real serials start at 1


def hash_block(parent_hash: int, tokens: Sequence[int]) -> int:
    """Chain hash of one full block: blake2b over the parent's hash and the token ids, as 64 bits.

    Stable across processes and machines (unlike ``hash()``), so the router's prefix-affinity
    policy and every replica compute the same keys.
    """
    data = parent_hash.to_bytes(8, "little") + struct.pack(f"<{len(tokens)}q", *tokens)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def _iter_hashes(token_ids: Sequence[int], block_size: int, salt: int = 0) -> Iterator[tuple[int, tuple[int, ...]]]:
    parent = ROOT_HASH if salt == 0 else hash_block(ROOT_HASH, (salt,))
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        chunk = tuple(token_ids[start : start + block_size])
        parent = hash_block(parent, chunk)
        yield parent, chunk


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """Chain hashes of every full block of ``token_ids`` (a trailing partial block has none)."""
    return [h for h, _ in _iter_hashes(token_ids, block_size)]


@dataclass
class Block:
    """One KV block's books. ``hash``/``token_ids``/``serial``/``parent`` are set only while registered."""

    block_id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: tuple[int, ...] = ()
    serial: int | None = None  # unique per registration: identifies this content
    parent: int | None = None  # serial of the block before it in the chain (_ROOT_SERIAL for the first)
    salt: int = 0  # its chain's salt


class BlockPool:
    """Allocates, shares, frees and caches fixed-size KV blocks; see the module docstring."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_cache: bool = True) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_cache = enable_prefix_cache
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: deque[int] = deque(range(num_blocks))
        self._cached: OrderedDict[int, None] = OrderedDict()  # LRU first
        self._by_hash: dict[int, int] = {}
        self._next_serial = _ROOT_SERIAL + 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks `allocate` can hand out now: never-used/unhashed free plus cached-but-unreferenced."""
        return len(self._free) + len(self._cached)

    @property
    def num_used_blocks(self) -> int:
        """Blocks with ref_count > 0."""
        return self.num_blocks - self.num_free_blocks

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= self.num_free_blocks

    def allocate(self, n: int) -> list[int]:
        """Return ``n`` fresh blocks (ref_count 1, no hash), evicting LRU cached blocks if needed.

        Raises `NoFreeBlocksError` without changing anything when fewer than ``n`` are free.
        """
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > self.num_free_blocks:
            raise NoFreeBlocksError(f"asked for {n}, {self.num_free_blocks} free")
        out: list[int] = []
        for _ in range(n):
            if self._free:
                bid = self._free.popleft()
            else:
                bid, _ = self._cached.popitem(last=False)
                self._unregister(self.blocks[bid])
            self.blocks[bid].ref_count = 1
            out.append(bid)
        return out

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference to each block; at zero a hashed block becomes cached, others free.

        A sequence passes its whole block table: the tail is released first so that it is evicted
        before the (more shareable) prefix. Raises ValueError, changing nothing, on an id out of
        range or a double free (more drops than references, counting repeats within the call).
        """
        drops = Counter(block_ids)
        for bid, k in drops.items():
            self._check_id(bid)
            if self.blocks[bid].ref_count < k:
                raise ValueError(f"double free of block {bid} (ref_count {self.blocks[bid].ref_count})")
        for bid in reversed(block_ids):
            block = self.blocks[bid]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.hash is not None:
                    self._cached[bid] = None
                else:
                    self._free.append(bid)

    def fork(self, block_ids: Sequence[int]) -> None:
        """Add one reference to each (already referenced) block: another sequence shares it."""
        for bid in block_ids:
            self._check_id(bid)
            if self.blocks[bid].ref_count == 0:
                raise ValueError(f"cannot fork unreferenced block {bid}")
        for bid in block_ids:
            self.blocks[bid].ref_count += 1

    def copy_on_write(self, block_ids: Sequence[int], position: int) -> tuple[list[int], tuple[int, int] | None]:
        """Make the block that holds ``position`` this sequence's own before it writes there.

        Returns the sequence's new table and, when that block was shared (ref_count > 1), the copy
        the caller must make on the device, ``(shared block, its fresh copy)``: the table names the
        copy, and the shared block loses this sequence's reference. An unshared block is returned
        as is, with no copy. Raises ValueError on a position the table does not reach and
        `NoFreeBlocksError` when a copy is needed and no block is free, changing nothing.
        """
        i = position // self.block_size
        if not 0 <= i < len(block_ids):
            raise ValueError(f"position {position} is outside a table of {len(block_ids)} blocks")
        shared = block_ids[i]
        self._check_id(shared)
        if self.blocks[shared].ref_count <= 1:
            return list(block_ids), None
        (copy,) = self.allocate(1)
        self.blocks[shared].ref_count -= 1  # still > 0: another sequence keeps it
        table = list(block_ids)
        table[i] = copy
        return table, (shared, copy)

    def match_prefix(self, token_ids: Sequence[int], salt: int = 0) -> list[int]:
        """Longest run of cached full blocks holding ``token_ids[:k * block_size]``, registered under
        ``salt``; each gets a reference.

        Callers pass only what they may reuse: ``prompt[:-1]``, so a block-aligned prompt still
        leaves at least one token to compute (its logits give the next token). Returns [] when
        prefix caching is off. Unreferenced hits leave the cached set (they cannot be evicted).
        """
        if not self.enable_prefix_cache:
            return []
        hits: list[int] = []
        parent = _ROOT_SERIAL
        for h, chunk in _iter_hashes(token_ids, self.block_size, salt):
            bid = self._by_hash.get(h)
            if bid is None:
                break
            block = self.blocks[bid]
            if block.token_ids != chunk or block.parent != parent or block.salt != salt:
                break  # hash collision, or the same tokens after a different prefix
            assert block.serial is not None
            parent = block.serial
            hits.append(bid)
        for bid in hits:
            if self.blocks[bid].ref_count == 0:
                del self._cached[bid]
            self.blocks[bid].ref_count += 1
        return hits

    def commit_full_blocks(self, block_ids: Sequence[int], token_ids: Sequence[int], salt: int = 0) -> None:
        """Register the full blocks of a sequence whose KV for ``token_ids`` is written, under ``salt``
        (what `match_prefix` must be asked with to find them).

        Block ``i`` holds tokens ``[i*bs, (i+1)*bs)``; a trailing partial block is left alone, so
        this is called again as the sequence grows (already registered blocks are checked, not redone).
        A block whose hash another block already holds stays unregistered (a duplicate nobody finds);
        on a collision with different content, registration stops there, since nothing after an
        unfindable block can be matched. Raises ValueError, changing nothing, on an unreferenced
        block, too few blocks, or a registered block whose tokens differ.
        """
        n_full = len(token_ids) // self.block_size
        if len(block_ids) < n_full:
            raise ValueError(f"{len(token_ids)} tokens need {n_full} full blocks, got {len(block_ids)}")
        if len(set(block_ids[:n_full])) != n_full:
            raise ValueError("repeated block id in one sequence")
        chain: list[tuple[int, tuple[int, ...]]] = []
        if self.enable_prefix_cache:
            chain = list(_iter_hashes(token_ids[: n_full * self.block_size], self.block_size, salt))
        for i, bid in enumerate(block_ids[:n_full]):
            self._check_id(bid)
            block = self.blocks[bid]
            if block.ref_count == 0:
                raise ValueError(f"cannot commit unreferenced block {bid}")
            if block.hash is not None and (block.hash, block.token_ids) != chain[i]:
                raise ValueError(f"block {bid} is registered with other contents")
        if not self.enable_prefix_cache:
            return
        parent = _ROOT_SERIAL
        for bid, (h, chunk) in zip(block_ids[:n_full], chain, strict=True):
            block = self.blocks[bid]
            owner_id = self._by_hash.setdefault(h, bid)
            if owner_id == bid:
                if block.hash is None:
                    block.hash, block.token_ids, block.serial, block.salt = h, chunk, self._next_serial, salt
                    self._next_serial += 1
                # Set, or for a block registered earlier whose recorded parent has since been
                # evicted, relinked to the parent found now (which holds the same prefix).
                block.parent = parent
                owner = block
            else:
                owner = self.blocks[owner_id]
                if (owner.token_ids, owner.parent, owner.salt) != (chunk, parent, salt):
                    return  # collision with other content: nothing after this block can be matched
            assert owner.serial is not None
            parent = owner.serial

    def reset_prefix_cache(self) -> None:
        """Forget every hash (e.g. after new weights): cached blocks go to the free list, and blocks
        in use stay in use but cannot be found by hash. O(num_blocks)."""
        for bid in self._by_hash.values():
            self._unregister(self.blocks[bid], keep_map=True)
        self._by_hash.clear()
        self._free.extend(self._cached)
        self._cached.clear()

    def check_integrity(self) -> None:
        """Raise AssertionError naming the first disagreement in the books. O(num_blocks)."""
        free, cached = set(self._free), set(self._cached)
        assert len(free) == len(self._free), "a block is on the free list twice"
        assert not free & cached, f"blocks both free and cached: {sorted(free & cached)}"
        used = 0
        for b in self.blocks:
            assert b.ref_count >= 0, f"block {b.block_id} has ref_count {b.ref_count}"
            registered = b.hash is not None
            assert registered == (b.serial is not None) == (b.parent is not None), f"block {b.block_id}"
            if b.hash is not None:
                assert self._by_hash.get(b.hash) == b.block_id, f"block {b.block_id} hash not mapped to it"
                assert len(b.token_ids) == self.block_size, f"block {b.block_id} is not full"
            if b.ref_count > 0:
                used += 1
                in_free = b.block_id in free or b.block_id in cached
                assert not in_free, f"block {b.block_id} is referenced yet free"
            elif registered:
                assert b.block_id in cached, f"unreferenced hashed block {b.block_id} not cached"
            else:
                assert b.block_id in free, f"unreferenced block {b.block_id} lost (not on the free list)"
        for h, bid in self._by_hash.items():
            assert self.blocks[bid].hash == h, f"hash map points {h:#x} at block {bid} holding another"
        assert used + len(free) + len(cached) == self.num_blocks, "counts do not add up"
        assert self.enable_prefix_cache or not self._by_hash, "hashes registered with prefix cache off"

    def _check_id(self, bid: int) -> None:
        if not 0 <= bid < self.num_blocks:
            raise ValueError(f"block id {bid} out of range [0, {self.num_blocks})")

    def _unregister(self, block: Block, keep_map: bool = False) -> None:
        if not keep_map:
            assert block.hash is not None
            del self._by_hash[block.hash]
        block.hash, block.token_ids, block.serial, block.parent, block.salt = None, (), None, None, 0


def fork_for_append(pool: BlockPool, block_ids: Sequence[int], num_tokens: int, share: bool = True
                    ) -> tuple[list[int], list[tuple[int, int]]]:
    """A new sequence that continues the one whose KV for ``num_tokens`` tokens is in ``block_ids``.

    The fork shares every full block (one more reference each) and gets its own slot for token
    ``num_tokens``: a fresh block when ``num_tokens`` is block-aligned, else a private copy of the
    shared partial last block (copy-on-write, done at the fork because the fork's very next token
    is written there). ``share=False``: every block is copied (for sequences that may rewrite their
    whole KV). Returns the fork's table and the copies ``(source, destination)`` for the caller to
    make on the device once the sources hold their KV. Takes one free block (``share=False``: one
    per block of ``num_tokens + 1`` slots); raises `NoFreeBlocksError` (changing nothing) when they
    are not free, ValueError when ``block_ids`` cannot hold ``num_tokens`` tokens.
    """
    bs = pool.block_size
    n_data = -(-num_tokens // bs)
    if num_tokens < 1 or len(block_ids) < n_data:
        raise ValueError(f"{len(block_ids)} blocks cannot hold the KV of {num_tokens} tokens")
    if not pool.can_allocate(1 if share else -(-(num_tokens + 1) // bs)):
        raise NoFreeBlocksError("a fork needs free blocks of its own, too few are free")
    table = list(block_ids[:n_data])
    pool.fork(table)
    if num_tokens % bs == 0:
        table += pool.allocate(1)
    copies: list[tuple[int, int]] = []
    for pos in range(num_tokens - num_tokens % bs if share else 0, num_tokens, bs):
        table, copy = pool.copy_on_write(table, pos)
        copies += [copy] if copy is not None else []
    return table, copies
