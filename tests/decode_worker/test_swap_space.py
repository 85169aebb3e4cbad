"""`HostSwapSpace` and the by-slot form of `KVCache.gather_blocks` / `scatter_blocks` it uses.

A swap lands in host memory allocated once (the same storage across swaps, on the host whatever the
cache's device), its bytes come back exactly into other block ids, slots are reused and accounted;
on CUDA the host buffer is pinned and a swap allocates nothing on the device.
"""

from __future__ import annotations

import pytest
import torch

from decode_worker.swap_space import HostSwapSpace
from engine.kv_cache import KVCache, paired_runs
from kv_transfer.layout import KVLayout
from tests.support.kv_caches import make_cache

LAYOUT = KVLayout(arch="llama", num_layers=3, num_kv_heads=2, head_dim=8, dtype="float32", block_size=4)


def blocks(cache: KVCache, ids: list[int]) -> list[torch.Tensor]:
    """Copies of blocks ``ids`` of every layer, K then V (what must come back)."""
    return [t[b].clone() for layer in range(cache.num_layers) for t in (cache.k[layer], cache.v[layer]) for b in ids]


def test_paired_runs_cut_where_either_side_jumps() -> None:
    assert paired_runs([5, 6, 9, 10], [0, 1, 2, 3]) == [(5, 0, 2), (9, 2, 2)]
    assert paired_runs([1, 2, 3], [7, 4, 5]) == [(1, 7, 1), (2, 4, 2)]
    with pytest.raises(ValueError, match="2 blocks but 1 slots"):
        paired_runs([1, 2], [0])


def test_swap_lands_in_one_host_buffer_and_comes_back_exactly() -> None:
    cache = make_cache(LAYOUT, 12, seed=1)
    space = HostSwapSpace(cache, 8)
    storage = space.buffer.untyped_storage().data_ptr()
    assert space.buffer.device.type == "cpu" and not space.buffer.is_pinned()  # a CPU cache: plain host memory
    a, b = [5, 2, 3], [9, 10]
    want_a, want_b = blocks(cache, a), blocks(cache, b)
    space.swap_out("a", cache, a)
    space.swap_out("b", cache, b)
    assert space.slots_of("a") == [0, 1, 2] and space.slots_of("b") == [3, 4] and space.num_free == 3
    for layer in range(cache.num_layers):  # the device blocks are reused by others meanwhile
        cache.k[layer].zero_()
        cache.v[layer].zero_()
    space.swap_in("b", cache, [0, 1])
    space.swap_in("a", cache, [7, 8, 11])
    assert all(torch.equal(x, y) for x, y in zip(blocks(cache, [7, 8, 11]), want_a, strict=True))
    assert all(torch.equal(x, y) for x, y in zip(blocks(cache, [0, 1]), want_b, strict=True))
    assert space.num_free == 8 and space.buffer.untyped_storage().data_ptr() == storage
    space.swap_out("c", cache, [4, 6, 7, 8, 11, 0, 1, 2])  # every slot, the freed ones reused
    assert sorted(space.slots_of("c")) == list(range(8)) and space.buffer.untyped_storage().data_ptr() == storage


def test_the_swap_space_refuses_what_it_cannot_hold_and_forgets_on_release() -> None:
    cache = make_cache(LAYOUT, 12, seed=2)
    space = HostSwapSpace(cache, 4)
    space.swap_out("a", cache, [0, 1, 2])
    with pytest.raises(RuntimeError, match="swap space full: b needs 2 blocks, 1 of 4 are free"):
        space.swap_out("b", cache, [3, 4])
    with pytest.raises(ValueError, match="a is already swapped out"):
        space.swap_out("a", cache, [5])
    with pytest.raises(ValueError, match="a holds 3 swapped blocks, 2 asked back"):
        space.swap_in("a", cache, [5, 6])
    space.release("a")
    space.release("never-swapped")
    assert space.num_free == 4
    with pytest.raises(KeyError, match="a is not swapped out"):
        space.swap_in("a", cache, [5, 6, 7])


def test_a_buffer_of_another_shape_or_dtype_is_refused() -> None:
    cache = make_cache(LAYOUT, 4, seed=3)
    with pytest.raises(ValueError, match=r"out has shape \(3, 2, 2, 4, 3, 8\); blocks of this cache are"):
        cache.gather_blocks([0, 1], out=torch.empty(3, 2, 2, 4, 3, 8))
    with pytest.raises(ValueError, match=r"contiguous torch\.float32"):
        cache.scatter_blocks([0], torch.empty(3, 2, 1, 4, 2, 8, dtype=torch.float16), slots=[0])


@pytest.mark.gpu
def test_a_cuda_swap_is_pinned_and_allocates_nothing_on_the_device() -> None:
    host = make_cache(LAYOUT, 16, seed=4)
    cache = KVCache(k=[t.cuda() for t in host.k], v=[t.cuda() for t in host.v], block_size=LAYOUT.block_size)
    space = HostSwapSpace(cache, 8)
    assert space.buffer.device.type == "cpu" and space.buffer.is_pinned()
    want = blocks(cache, [3, 4, 9])
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    space.swap_out("a", cache, [3, 4, 9])
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() == before, "a swap-out allocated on the device"
    for t in cache.k + cache.v:
        t.zero_()
    space.swap_in("a", cache, [0, 1, 2])
    torch.cuda.synchronize()
    assert all(torch.equal(x, y) for x, y in zip(blocks(cache, [0, 1, 2]), want, strict=True))
