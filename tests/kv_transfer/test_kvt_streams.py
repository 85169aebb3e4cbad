"""Layer streams and the staging pool: the staging-mode wire order, cancellation, buffer reuse, the budget."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kv_transfer import streams
from kv_transfer.blocks import block_runs, direct_views, run_lengths, source_tensors
from kv_transfer.errors import TransferError, TransferTimeout
from kv_transfer.staging import StagingPool
from kv_transfer.streams import GatherStream, ScatterStream, size_class
from tests.support.kv_caches import SMOL, digest, make_cache

LAYOUT = dataclasses.replace(SMOL, num_layers=5)


def pipe(src: GatherStream, dst: ScatterStream) -> None:
    """What a transport does, minus the wire: fill slot, copy slot to slot, drain."""
    src.reserve(5)
    dst.reserve(5)
    assert src.count == dst.count and src.chunk_nbytes == dst.chunk_nbytes
    for i in range(src.count):
        src.fill(i)
        dst.buffer(i).copy_(src.buffer(i))
        dst.drain(i)


def test_gather_then_scatter_moves_exactly_the_blocks() -> None:
    src, dst = make_cache(LAYOUT, 32, seed=3), make_cache(LAYOUT, 32)
    pool = StagingPool(64 << 20)
    sb, db = [4, 5, 6, 20, 1], [31, 0, 7, 8, 9]
    pipe(GatherStream(src, sb, pool), ScatterStream(dst, db, pool))
    assert digest(src, sb) == digest(dst, db)
    untouched = [b for b in range(32) if b not in db]
    assert not any(dst.k[layer][untouched].any() or dst.v[layer][untouched].any() for layer in range(5))


def test_cancelled_scatter_never_writes() -> None:
    src, dst = make_cache(LAYOUT, 8, seed=3), make_cache(LAYOUT, 8)
    pool = StagingPool(64 << 20)
    g, s = GatherStream(src, [1, 2], pool), ScatterStream(dst, [3, 4], pool)
    g.reserve(5)
    s.reserve(5)
    g.fill(0)
    s.buffer(0).copy_(g.buffer(0))
    s.cancel()
    with pytest.raises(TransferError, match="cancelled"):
        s.drain(0)
    assert not dst.k[0].any()
    g.cancel()
    with pytest.raises(TransferError):
        g.fill(1)


def test_pool_reuses_buffers_after_completion_only() -> None:
    cache = make_cache(LAYOUT, 8, seed=1)
    pool = StagingPool(max_bytes=10 << 20)
    s = GatherStream(cache, [1, 2, 3], pool)
    s.reserve(5)
    ptrs = {s.buffer(i).data_ptr() for i in range(s.window)}
    ring_bytes = s.window * size_class(s.chunk_nbytes)
    assert pool.lent_bytes == ring_bytes and pool.held_bytes == 0
    s.complete()
    assert pool.held_bytes == ring_bytes and pool.lent_bytes == 0
    s2 = GatherStream(cache, [4, 5, 6], pool)
    s2.reserve(5)
    assert {s2.buffer(i).data_ptr() for i in range(s2.window)} == ptrs and pool.held_bytes == 0
    c2 = s2.chunk_nbytes
    s2.complete()
    s3 = GatherStream(cache, [4, 5, 6, 7], pool)  # another length, same size class: the same buffers
    s3.reserve(5)
    assert s3.chunk_nbytes != c2 and size_class(s3.chunk_nbytes) == size_class(c2)
    assert {s3.buffer(i).data_ptr() for i in range(s3.window)} == ptrs
    s3.finish(ok=False)  # after a failure: dropped, not kept, no longer counted
    assert pool.held_bytes == 0 and pool.lent_bytes == 0


def test_pool_never_holds_more_than_its_budget() -> None:
    cls = 1 << 20
    pool = StagingPool(max_bytes=3 * cls)
    a = pool.take(cls, 2, torch.float32, torch.device("cpu"), 1)
    b = pool.take(cls, 4, torch.float32, torch.device("cpu"), 1)  # only one left: one, not four
    assert (len(a), len(b), pool.lent_bytes) == (2, 1, 3 * cls)
    with pytest.raises(TransferTimeout, match="max_inflight_bytes"):
        pool.take(cls, 1, torch.float32, torch.device("cpu"), 0.2)
    with pytest.raises(TransferError, match="cancelled"):
        pool.take(cls, 1, torch.float32, torch.device("cpu"), 5, cancelled=lambda: True)
    pool.give(a)
    big = pool.take(2 * cls, 1, torch.float32, torch.device("cpu"), 1)  # idle 1 MiB buffers make room
    assert len(big) == 1 and pool.held_bytes == 0 and pool.lent_bytes == 3 * cls
    pool.give(b + big)
    assert pool.peak_bytes == 3 * cls
    with pytest.raises(TransferError, match="does not fit"):
        pool.take(4 * cls, 1, torch.float32, torch.device("cpu"), 1)


def test_chunking_groups_layers_of_small_transfers() -> None:
    from kv_transfer.streams import CHUNK_BYTES, layers_per_chunk

    layer = 8 * SMOL.block_nbytes // SMOL.num_layers  # 128 tokens of SmolLM2: 196,608 B per layer
    assert layers_per_chunk(30, layer) == 5 and 5 * layer <= CHUNK_BYTES
    assert layers_per_chunk(30, CHUNK_BYTES + 1) == 1
    assert layers_per_chunk(7, 1) == 7
    cache = make_cache(SMOL, 8, seed=2)
    s = GatherStream(cache, list(range(8)), StagingPool(64 << 20))
    assert {c.layers for c in s.chunks} == {5} and s.count == 6
    dst = make_cache(SMOL, 8)
    pipe(s, ScatterStream(dst, list(range(8)), StagingPool(64 << 20)))
    assert digest(cache, range(8)) == digest(dst, range(8))


def test_runs_and_direct_views_line_up() -> None:
    assert block_runs([5, 6, 7, 2, 3, 9]) == [(5, 3), (2, 2), (9, 1)]
    assert run_lengths([0]) == (1,)
    src, dst = make_cache(LAYOUT, 16, seed=5), make_cache(LAYOUT, 16)
    sb, db = [1, 9, 3, 4, 5], [10, 11, 2, 3, 15]
    sent = source_tensors(src, sb, run_lengths(db))
    into = direct_views(dst, db)
    assert [t.shape for t in sent] == [t.shape for t in into]
    for a, b in zip(sent, into, strict=True):
        b.copy_(a)
    assert digest(src, sb) == digest(dst, db)
    assert torch.equal(source_tensors(src, sb, None)[0], src.gather_blocks(sb))


def test_large_layers_travel_in_bounded_slices_whatever_the_fragmentation(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(streams, "MAX_CHUNK_BYTES", 3 * (LAYOUT.block_nbytes // LAYOUT.num_layers))
    src, dst = make_cache(LAYOUT, 32, seed=4), make_cache(LAYOUT, 32)
    sb, db = list(range(0, 20, 2)), list(range(31, 11, -2))  # 10 blocks; neither side has two in a row
    g, s = GatherStream(src, sb, StagingPool(64 << 20)), ScatterStream(dst, db, StagingPool(64 << 20))
    assert [(c.blocks, c.layers) for c in g.chunks[:4]] == [(3, 1), (3, 1), (3, 1), (1, 1)]
    assert g.count == LAYOUT.num_layers * 4  # ceil(10 / 3) slices per layer, not one per block
    assert g.chunk_nbytes <= streams.MAX_CHUNK_BYTES
    pipe(g, s)
    assert digest(src, sb) == digest(dst, db)
    untouched = [b for b in range(32) if b not in db]
    assert not any(dst.k[layer][untouched].any() for layer in range(LAYOUT.num_layers))
