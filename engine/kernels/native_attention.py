"""Paged decode attention as a small C++ kernel, compiled for this machine on first use.

Owns: loading ``engine/kernels/csrc/paged_decode.cpp`` (built by `engine.kernels.native_build`) and
`native_paged_attention`, the ``"native"`` method of `attention.paged_decode_attention`.

Why: the eager paths copy each sequence's blocks before multiplying, and inductor's fused kernel
(`engine.kernels.compiled_attention`) reads the context once per softmax pass and per KV head. The kernel
reads each sequence's blocks once for the scores of every head and once for the weighted sum (fp32
math, visible positions only), batch 1 cut into chunks over every thread, each block two reads ahead
prefetched into L2 (blocks lie anywhere in the cache, so the hardware prefetcher cannot guess them),
16-float vectors where AVX-512 is there. With the cache on huge pages (`engine.kernels.huge_pages`)
a step's attention reads the cache close to the rate a plain ``sum`` over it does (figures:
docs/benchmarks-notes.md).

Invariants: built and cached by `engine.kernels.native_build` (hash-named, never half-written, no
fast-math); the kernel runs on ``torch.get_num_threads()`` threads of torch's OpenMP runtime.
Every argument is checked here (dtype, contiguity, shapes, ``1 <= lengths[b] <= n_blocks *
block_size``) because the kernel trusts them; block ids are
the caller's to keep in range (`engine.runner` checks every table it builds).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from engine.kernels.native_build import CSRC, NativeUnavailable, build_with, unavailable_reason

SOURCE = CSRC / "paged_decode.cpp"
_P, _I = ctypes.c_void_p, ctypes.c_int64
_ARGTYPES = [_P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I, _I, ctypes.c_float, ctypes.c_int]
__all__ = ["NativeUnavailable", "load", "native_error", "native_paged_attention"]


@functools.cache
def load() -> ctypes.CDLL:
    """The built library (compiled on the first call in any process, then reused)."""
    return build_with(SOURCE, ["paged_decode_f32", "paged_decode_bf16"], _ARGTYPES)


def native_error() -> str | None:
    """None if the kernel builds and loads here, else why not."""
    return unavailable_reason(load)


def native_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q [B, H, D]; caches [num_blocks, bs, KV, D] (fp32 or bf16, contiguous, CPU); block_table
    [B, nb] int64; lengths [B] int64 visible positions → [B, H * D] in q's dtype."""
    b, h, d = q.shape
    _, bs, kvh, dk = k_cache.shape
    if k_cache.dtype not in (torch.float32, torch.bfloat16) or v_cache.dtype != k_cache.dtype:
        raise TypeError(f"native decode attention takes fp32 or bf16 caches, got {k_cache.dtype}/{v_cache.dtype}")
    if k_cache.device.type != "cpu" or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("native decode attention needs contiguous CPU caches")
    if dk != d or v_cache.shape != k_cache.shape or h % kvh:
        raise ValueError(f"head geometry mismatch: q {tuple(q.shape)}, cache {tuple(k_cache.shape)}")
    if block_table.dtype != torch.long or block_table.dim() != 2 or block_table.shape[0] != b:
        raise ValueError(f"block_table must be int64 [B={b}, nb], got {block_table.dtype} {tuple(block_table.shape)}")
    if lengths.dtype != torch.long or tuple(lengths.shape) != (b,):
        raise ValueError(f"lengths must be int64 [B={b}], got {lengths.dtype} {tuple(lengths.shape)}")
    lo, hi = (int(x) for x in torch.aminmax(lengths))  # the kernel reads positions [0, lengths[b])
    if lo < 1 or hi > block_table.shape[1] * bs:
        raise ValueError(f"lengths must lie in [1, {block_table.shape[1] * bs}], got [{lo}, {hi}]")
    lib = load()
    qf = q.float().contiguous()  # [B, H, D]
    table, lens = block_table.contiguous(), lengths.contiguous()
    out = torch.empty(b, h, d, dtype=torch.float32)
    fn = lib.paged_decode_f32 if k_cache.dtype == torch.float32 else lib.paged_decode_bf16
    fn(qf.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), table.data_ptr(), lens.data_ptr(), out.data_ptr(),
       b, h, kvh, d, bs, table.shape[1], scale, torch.get_num_threads())
    return out.view(b, h * d).to(q.dtype)
