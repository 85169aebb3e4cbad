"""Causal fp32 prefill attention as a C++ kernel, compiled for this machine on first use.

Owns: loading ``engine/kernels/csrc/prefill_attention.cpp`` (built by `engine.kernels.native_build`),
`native_prefill_applies` and `native_prefill_attention`, which `engine.attention.ops.prefill_attention`
runs for fp32 chunks where `engine.kernels.prefill_choice` timed it faster than SDPA on this machine
(bf16 stays on torch's SDPA, which uses AMX where oneDNN has it).

Why: on CPUs with 16-lane vector units, torch's fp32 CPU ``scaled_dot_product_attention`` (its flash
kernel) reaches a fraction of the FLOP rate its fp32 matmuls reach, and causal attention is a sizeable
share of an fp32 prefill; on 8-lane units this kernel's tiles spill registers and SDPA is faster. The
kernel (flash-attention style: K transposed once, outer-product score tiles, online softmax, P V
tiles; the query heads of a KV head together) does the same work without a score matrix, at a
higher FLOP rate (figures: docs/benchmarks-notes.md).

Invariants: equals SDPA with ``is_causal`` (query i at position ``start + i`` sees keys ``<= start + i``)
up to fp32 reassociation; q, k and v may be strided views (rows any stride, heads contiguous: the
slices of a qkv product), checked here because the kernel trusts them; the result is a new
contiguous [S, H, D] tensor, independent of the thread count.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from engine.kernels.native_build import CSRC, build_with_or_none

SOURCE = CSRC / "prefill_attention.cpp"
_P, _I = ctypes.c_void_p, ctypes.c_int64
_ARGTYPES = [_P, _I, _P, _I, _P, _I, _P, _I, _I, _I, _I, _I, _I, ctypes.c_float, ctypes.c_int]
HEAD_DIMS = (64, 128)


@functools.cache
def load() -> ctypes.CDLL | None:
    """The built library, or None where it cannot be built here (SDPA runs instead)."""
    return build_with_or_none(SOURCE, ["prefill_attention_f32"], _ARGTYPES)


def _rows_ok(t: torch.Tensor) -> bool:
    """[N, heads, D] with heads and D contiguous (any stride between rows)."""
    return t.dim() == 3 and t.stride(2) == 1 and t.stride(1) == t.shape[2] and t.stride(0) >= t.shape[1] * t.shape[2]


def native_prefill_applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the kernel takes these operands: fp32 CPU, head size 64 or 128, whole GQA groups, rows
    laid out as it reads them, and a library that built."""
    return (q.dtype == k.dtype == v.dtype == torch.float32 and q.device.type == k.device.type == "cpu"
            and q.shape[2] in HEAD_DIMS and k.shape[2] == v.shape[2] == q.shape[2] and k.shape == v.shape
            and k.shape[1] > 0 and q.shape[1] % k.shape[1] == 0
            and all(_rows_ok(t) for t in (q, k, v)) and load() is not None)


def native_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
                             scale: float) -> torch.Tensor:
    """q [S, H, D] at positions ``start .. start + S - 1``; k, v [L, KV, D] at positions ``0 .. L - 1``
    (``L >= start + S``) → [S, H, D], causal. Call only where `native_prefill_applies`."""
    s, h, d = q.shape
    n, kvh, _ = k.shape
    if not native_prefill_applies(q, k, v):
        raise ValueError(f"native prefill attention does not take q {q.dtype} {tuple(q.shape)} / "
                         f"k {k.dtype} {tuple(k.shape)}")
    if start < 0 or n < start + s:
        raise ValueError(f"{n} keys cannot cover queries at positions {start}..{start + s - 1}")
    lib = load()
    assert lib is not None
    out = torch.empty(s, h, d, dtype=torch.float32)
    lib.prefill_attention_f32(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
                              out.data_ptr(), s, n, h, kvh, d, start, scale, torch.get_num_threads())
    return out
