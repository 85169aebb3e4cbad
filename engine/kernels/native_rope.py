"""RoPE on q and k and the store of k, v into the paged cache, as one C++ call per layer.

Owns: loading ``engine/kernels/csrc/rope_store.cpp`` (built by `engine.kernels.native_build`), `native_rope_error`,
and `RopeStore`, which checks a forward's positions, table rows and slots once and then, for every
layer, rotates the q and k heads of the qkv product in place (their first R dims: the tables' width)
and copies k and v to their cache slots.

Why: on the eager fast path the same work is a roll, a multiply, an addcmul, views and two
``index_copy_`` calls per layer, whose dispatch costs far more than the arithmetic at decode
batch sizes. A prefill chunk's rows (64 and more) are split over the threads.

Invariants: the result equals the eager path's (``x * cos + roll(x, R/2) * sin_signed`` on a head's
first R dims, the rest left as they are, then ``write_kv``) up to fp32 rounding: the math is fp32
from fp32 tables, rounded once to bf16 (the eager bf16 path rounds after each op); every index the
kernel uses is checked here first (table rows < the tables' rows, slots < cache slots) because the
kernel trusts them; nothing but the qkv rows and the given slots is written.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from engine.kernels.native_build import CSRC, build_with, unavailable_reason

SOURCE = CSRC / "rope_store.cpp"
_P, _I = ctypes.c_void_p, ctypes.c_int64
_ARGTYPES = [_P, _P, _P, _P, _P, _P, _P, _I, _I, _I, _I, _I]
MAX_HEAD_DIM = 1024  # the kernel's per-head scratch


@functools.cache
def load() -> ctypes.CDLL:
    """The built library (compiled on the first call in any process, then reused)."""
    return build_with(SOURCE, ["rope_store_f32", "rope_store_bf16"], _ARGTYPES)


def native_rope_error() -> str | None:
    """None if the kernel builds and loads here, else why not."""
    return unavailable_reason(load)


@dataclass(frozen=True)
class RopeStore:
    """One forward's positions, table rows and slots, checked; call it once per layer (`for_batch` builds it)."""

    positions: torch.Tensor  # [T] int64, contiguous, each >= 0
    rows: torch.Tensor  # [T] int64, contiguous: each token's row of the tables, < cos.shape[0]
    slots: torch.Tensor  # [T] int64, contiguous, each < the cache's slots
    cos: torch.Tensor  # [N, R] fp32
    sin_signed: torch.Tensor  # [N, R] fp32: [-sin[:, :R/2] | sin[:, R/2:]]
    num_heads: int
    num_kv_heads: int
    head_dim: int  # D >= R: a head's dims from R on are not rotated
    cache_slots: int  # the slots were checked against a cache of this many

    @classmethod
    def for_batch(cls, positions: torch.Tensor, slots: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor,
                  num_heads: int, num_kv_heads: int, cache_slots: int, *, head_dim: int | None = None,
                  rows: torch.Tensor | None = None) -> RopeStore:
        """``rows``: each token's row of the tables (default: its position); ``head_dim``: default R."""
        t = positions.shape[0]
        rows = positions if rows is None else rows
        d = cos.shape[1] if head_dim is None else head_dim
        if positions.dtype != torch.long or slots.dtype != torch.long or rows.dtype != torch.long or \
                tuple(slots.shape) != (t,) or tuple(rows.shape) != (t,):
            raise ValueError(f"positions, rows and slots must be int64 [T], got {positions.dtype} "
                             f"{tuple(positions.shape)}, {rows.dtype} {tuple(rows.shape)} and {slots.dtype} "
                             f"{tuple(slots.shape)}")
        r = cos.shape[1]
        if cos.dtype != torch.float32 or sin_signed.shape != cos.shape or r % 2 or not 0 < r <= d <= MAX_HEAD_DIM:
            raise ValueError(f"rope tables must be fp32 [N, R] with R even and R <= head_dim {d} <= {MAX_HEAD_DIM}, "
                             f"got {cos.dtype} {tuple(cos.shape)}")
        if t:
            lo, hi = (int(x) for x in torch.aminmax(rows))
            if lo < 0 or hi >= cos.shape[0]:
                raise ValueError(f"positions must lie in [0, {cos.shape[0]}), got [{lo}, {hi}]")
            if rows is not positions and int(positions.min()) < 0:  # where rows are the positions: checked above
                raise ValueError(f"positions must be >= 0, got {int(positions.min())}")
            lo, hi = (int(x) for x in torch.aminmax(slots))
            if lo < 0 or hi >= cache_slots:
                raise ValueError(f"slots must lie in [0, {cache_slots}), got [{lo}, {hi}]")
        return cls(positions.contiguous(), rows.contiguous(), slots.contiguous(), cos.contiguous(),
                   sin_signed.contiguous(), num_heads, num_kv_heads, d, cache_slots)

    def __call__(self, qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        """qkv [T, (H + 2 KV) * D] (rotated in place); caches [num_blocks, BS, KV, D], same dtype."""
        t, d, h, kvh = self.positions.shape[0], self.head_dim, self.num_heads, self.num_kv_heads
        if qkv.dtype not in (torch.float32, torch.bfloat16) or not qkv.is_contiguous() or \
                tuple(qkv.shape) != (t, (h + 2 * kvh) * d):
            raise ValueError(f"qkv must be a contiguous fp32/bf16 [{t}, {(h + 2 * kvh) * d}], "
                             f"got {qkv.dtype} {tuple(qkv.shape)}")
        if k_cache.dtype != qkv.dtype or v_cache.dtype != qkv.dtype or k_cache.shape != v_cache.shape or \
                tuple(k_cache.shape[2:]) != (kvh, d) or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            raise ValueError(f"caches must be contiguous {qkv.dtype} [num_blocks, BS, {kvh}, {d}], "
                             f"got {k_cache.dtype} {tuple(k_cache.shape)}")
        if k_cache.shape[0] * k_cache.shape[1] < self.cache_slots:
            raise ValueError(f"the slots were checked for {self.cache_slots} cache slots, this cache has "
                             f"{k_cache.shape[0] * k_cache.shape[1]}")
        fn = load().rope_store_f32 if qkv.dtype == torch.float32 else load().rope_store_bf16
        fn(qkv.data_ptr(), self.cos.data_ptr(), self.sin_signed.data_ptr(), self.rows.data_ptr(),
           self.slots.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), t, h, kvh, d, self.cos.shape[1])
