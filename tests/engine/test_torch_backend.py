"""The ``torch`` backend (`engine.attention.torch_backend`) against the reference ops, on CPU.

Every layer kind (GQA 4 heads / 2 KV heads, a sliding window, a soft-cap, partial rotary) through
packed fresh chunks, chunks after a prefix in scattered blocks, and decode rows with padded block
tables, over a cache whose every other slot holds random values (a leak shows). fp32 within 1e-5.
bf16 against the fp32 oracle on the same (bf16-rounded) inputs within atol = rtol = 5e-2: bf16 keeps
8 significant bits (a relative step of 2^-8), q and k are rounded after rotation, and scores here
reach ~10 (scale 0.25 over 16 dims of values up to ~8), so a score moves by up to ~0.04 and a
weight by ~4%; outputs, convex combinations of values up to ~8, move by a few hundredths. A key
wrongly seen or hidden moves an output by ~1. Flex runs eager here (the block lists are checked on
their own, and one test runs the compiled kernel, which reads only the listed blocks).
"""

from __future__ import annotations

import pytest
import torch

from engine.attention.base import LayerAttention
from engine.attention.flex_meta import Q_BLOCK
from engine.attention.registry import backend_class
from engine.attention.torch_backend import TorchBackend, TorchStep
from engine.config import EngineConfig
from engine.model.rope_params import RopeScaling
from tests.support.attention_oracle import reference_decode, reference_prefill
from tests.support.markers import needs_cxx
from tests.support.paged_batches import decode_batch, make_cache, make_spec, prefill_batch, scattered_tables

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

BS, NB = 16, 24
SCALE = 0.25
#: plain, windowed, soft-capped, partial rotary (ropes[1] rotates half of each head)
LAYERS = (LayerAttention(0, SCALE), LayerAttention(0, SCALE, window=8), LayerAttention(0, SCALE, softcap=5.0),
          LayerAttention(1, SCALE))


def backend(dtype: torch.dtype = torch.float32, compiled: bool | None = False,
            layers: tuple[LayerAttention, ...] = LAYERS, device: str = "cpu",
            scaling: RopeScaling | None = None) -> TorchBackend:
    spec = make_spec(layers, partial_factors=(1.0, 0.5), dtype=dtype, device=device, scaling=scaling)
    config = EngineConfig(device=device, dtype="float32", block_size=BS, num_blocks=NB)
    return TorchBackend(spec, config, compiled=compiled)


def qkv_for(b: TorchBackend, tokens: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    width = b.spec.q_size + 2 * b.spec.kv_size
    return torch.randn(tokens, width, generator=g).to(b.spec.device, b.spec.dtype)  # [T, q + 2kv]


def scaling(b: TorchBackend) -> RopeScaling | None:
    return b.spec.ropes[0].rope.params.scaling


def check_prefill(b: TorchBackend, starts: list[int], lens: list[int], shared: int = 0, tol: float = 1e-5) -> None:
    tables = scattered_tables([-(-(s + n) // BS) for s, n in zip(starts, lens, strict=True)], NB, seed=1, shared=shared)
    batch = prefill_batch(starts, lens, tables, BS)
    cache = make_cache(b.spec, NB, BS)
    meta = b.prepare_prefill(prefill_batch(starts, lens, tables, BS, device=b.spec.device.type), cache)
    ref_spec = make_spec(b.spec.layers, partial_factors=(1.0, 0.5), scaling=scaling(b))  # fp32 oracle
    for layer in range(len(b.spec.layers)):
        qkv = qkv_for(b, sum(lens), seed=layer)
        ref_cache = make_cache(ref_spec, NB, BS)
        ref_cache.k[layer].copy_(cache.k[layer].cpu())
        ref_cache.v[layer].copy_(cache.v[layer].cpu())
        want, want_k, want_v = reference_prefill(ref_spec, layer, qkv.float().cpu(), ref_cache, batch)
        got = b.forward(layer, qkv, cache, meta).cpu()
        assert got.shape == want.shape and got.dtype == b.spec.dtype
        torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol, msg=f"layer {layer}")
        torch.testing.assert_close(cache.k[layer].float().cpu(), want_k, atol=tol, rtol=tol)
        torch.testing.assert_close(cache.v[layer].float().cpu(), want_v, atol=tol, rtol=tol)


def check_decode(b: TorchBackend, positions: list[int], tol: float = 1e-5) -> None:
    tables = scattered_tables([p // BS + 1 for p in positions], NB, seed=2)
    tables[-1][0] = 0  # block 0 is also what padding names: a real block of the longest row
    batch = decode_batch(positions, tables, BS, width=8)
    cache = make_cache(b.spec, NB, BS, seed=3)
    meta = b.prepare_decode(decode_batch(positions, tables, BS, width=8, device=b.spec.device.type), cache)
    ref_spec = make_spec(b.spec.layers, partial_factors=(1.0, 0.5), scaling=scaling(b))
    for layer in range(len(b.spec.layers)):
        qkv = qkv_for(b, len(positions), seed=10 + layer)
        ref_cache = make_cache(ref_spec, NB, BS)
        ref_cache.k[layer].copy_(cache.k[layer].cpu())
        ref_cache.v[layer].copy_(cache.v[layer].cpu())
        want, want_k, want_v = reference_decode(ref_spec, layer, qkv.float().cpu(), ref_cache, batch)
        got = b.forward(layer, qkv, cache, meta).cpu()
        torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol, msg=f"layer {layer}")
        torch.testing.assert_close(cache.k[layer].float().cpu(), want_k, atol=tol, rtol=tol)
        torch.testing.assert_close(cache.v[layer].float().cpu(), want_v, atol=tol, rtol=tol)


def test_packed_fresh_chunks_of_different_lengths() -> None:
    b = backend()
    meta = b.prepare_prefill(prefill_batch([0, 0, 0], [5, 17, 40], scattered_tables([1, 2, 3], NB), BS),
                             make_cache(b.spec, NB, BS))
    assert isinstance(meta, TorchStep) and meta.fresh_lens == [5, 17, 40]  # SDPA takes the plain layers
    check_prefill(b, [0, 0, 0], [5, 17, 40])


def test_chunks_after_a_prefix_in_scattered_blocks() -> None:
    check_prefill(backend(), [16, 37, 0, 70], [9, 20, 3, 1])


def test_chunks_sharing_prefix_blocks_in_one_tile() -> None:
    check_prefill(backend(), [32, 32, 33], [3, 5, 4], shared=2)


def test_decode_rows_of_different_lengths_with_padded_tables() -> None:
    check_decode(backend(), [0, 5, 16, 40, 77, 100])


def test_length_dependent_rope_takes_each_forward_calls_table() -> None:
    """Dynamic NTK: prompts longer than 32 tokens rotate by a grown base, in prefill and in decode."""
    b = backend(scaling=RopeScaling("dynamic", 2.0, max_position_embeddings=32))
    assert b.spec.length_dependent
    check_prefill(b, [0, 20, 0], [40, 30, 10])
    check_decode(b, [10, 40, 77])


def test_bf16_within_its_rounding() -> None:
    b = backend(torch.bfloat16)
    check_prefill(b, [0, 21], [12, 30], tol=5e-2)
    check_decode(b, [3, 33, 64], tol=5e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_cuda_equals_the_reference(dtype: torch.dtype) -> None:
    """Compiled flex and, in bf16, FlashAttention's varlen kernel for the fresh chunks."""
    b = backend(dtype, compiled=None, device="cuda")
    tol = 1e-4 if dtype == torch.float32 else 5e-2  # fp32: the GPU kernels reassociate more
    check_prefill(b, [0, 0, 0], [5, 17, 40], tol=tol)
    check_prefill(b, [16, 37, 0, 70], [9, 20, 3, 1], shared=0, tol=tol)
    check_prefill(b, [32, 32, 33], [3, 5, 4], shared=2, tol=tol)
    check_decode(b, [0, 5, 16, 40, 77, 100], tol=tol)


@needs_cxx
def test_compiled_flex_reads_only_the_listed_blocks() -> None:
    """The compiled kernel skips blocks a tile does not list: the lists must hold every visible key."""
    b = backend(compiled=True, layers=(LayerAttention(0, SCALE, window=20),))
    check_prefill(b, [16, 40], [9, 20], shared=1)
    check_prefill(b, [3], [30])  # new shapes: the dynamic-shape recompile every later step runs
    check_decode(b, [5, 40, 77])


def test_block_lists_cover_every_visible_key_once() -> None:
    b = backend()
    starts, lens = [32, 32, 0, 50], [3, 5, 20, 30]
    batch = prefill_batch(starts, lens, scattered_tables([3, 3, 2, 5], NB, shared=2), BS)
    masks = b.prepare_prefill(batch, make_cache(b.spec, NB, BS)).paged
    assert masks is not None
    t = sum(lens)
    for window, mask in masks.masks.items():
        seen = mask.mask_mod(torch.tensor(0), torch.tensor(0), torch.arange(t)[:, None], torch.arange(NB * BS)[None])
        for tile in range(-(-t // Q_BLOCK)):
            listed = mask.kv_indices[0, 0, tile, : int(mask.kv_num_blocks[0, 0, tile])].tolist()
            needed = set((seen[tile * Q_BLOCK: (tile + 1) * Q_BLOCK].any(0).nonzero().flatten() // BS).tolist())
            assert len(listed) == len(set(listed)), f"window {window} tile {tile} lists a block twice"
            assert needed <= set(listed), f"window {window} tile {tile} misses {needed - set(listed)}"
    full, windowed = masks.masks[None], masks.masks[8]
    assert int(windowed.kv_num_blocks.sum()) < int(full.kv_num_blocks.sum())  # the window prunes blocks


def test_decode_block_lists_are_the_rows_own_blocks() -> None:
    b = backend()
    positions = [3, 40, 77]
    tables = scattered_tables([p // BS + 1 for p in positions], NB, seed=4)
    masks = b.prepare_decode(decode_batch(positions, tables, BS, width=8), make_cache(b.spec, NB, BS)).paged
    assert masks is not None
    for row, (p, table) in enumerate(zip(positions, tables, strict=True)):
        listed = masks.masks[None].kv_indices[row, 0, 0, : int(masks.masks[None].kv_num_blocks[row, 0, 0])]
        assert listed.tolist() == table[: p // BS + 1].tolist()
        windowed = masks.masks[8].kv_indices[row, 0, 0, : int(masks.masks[8].kv_num_blocks[row, 0, 0])]
        assert windowed.tolist() == table[max(0, p - 7) // BS: p // BS + 1].tolist()


@pytest.mark.parametrize("decode", [False, True])
def test_flex_reads_the_cache_in_place(decode: bool) -> None:
    """No gather of the context: flex gets the layer's cache itself, every slot of it, as keys and values."""
    b = backend()
    calls: list[tuple[torch.Tensor, torch.Tensor]] = []
    flex = b.flex

    def spy(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: object) -> torch.Tensor:
        calls.append((k, v))
        return flex(q, k, v, **kw)

    b.flex = spy
    cache = make_cache(b.spec, NB, BS)
    if decode:
        batch_d = decode_batch([20, 50], scattered_tables([2, 4], NB), BS, width=4)
        meta = b.prepare_decode(batch_d, cache)
    else:
        meta = b.prepare_prefill(prefill_batch([16, 30], [4, 6], scattered_tables([2, 3], NB), BS), cache)
    b.forward(0, qkv_for(b, 2 if decode else 10, seed=0), cache, meta)
    (k, v), = calls
    assert k.data_ptr() == cache.k[0].data_ptr() and v.data_ptr() == cache.v[0].data_ptr()
    assert k.shape[-2] == NB * BS


def test_registered_and_available_on_cpu() -> None:
    assert backend_class("torch") is TorchBackend
    config = EngineConfig(block_size=BS, num_blocks=NB)
    why = TorchBackend.unavailable(make_spec(LAYERS, (1.0, 0.5)), config)
    assert why is None  # eager flex on a CPU: no compiler needed
    assert "head_dim 12" in str(TorchBackend.unavailable(make_spec(LAYERS, (1.0, 0.5), head_dim=12), config))
    assert "float64" in str(TorchBackend.unavailable(make_spec(LAYERS, (1.0, 0.5), dtype=torch.float64), config))
