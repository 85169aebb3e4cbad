"""Which causal prefill attention serves fp32 chunks on this machine: the C++ kernel or torch's SDPA.

Owns `PrefillChoice`, `pick` and `remembered_prefill_attention`, which the ``cpu`` attention backend
asks once per engine. Why measure: the C++ kernel (`engine.kernels.native_prefill`) computes its
score and P·V tiles in 16-float vectors, which beat SDPA's fp32 flash kernel where the CPU has
16-lane vector units (AVX-512); on 8-lane units (AVX2) each of its 16 accumulators takes two
registers, they spill, and it falls far behind SDPA. Which one wins is a property of the machine,
so it is timed here rather than assumed (figures per host: docs/benchmarks-notes.md).

How: one causal chunk of `TIMED_TOKENS` tokens of the model's head geometry, from an empty cache,
through each (`engine.kernels.kernel_choice.best_of_interleaved`: interleaved, best of
``repeats``); the kernel is chosen when it takes at most ``1 - MARGIN`` of SDPA's time, so a tie
keeps torch's own.

Invariants: both compute SDPA's causal attention up to fp32 reassociation (the kernel is tested
against it), so the choice changes speed only; a chunk the kernel does not take (not fp32, a head
dim it lacks, a library that does not build here) gets SDPA without timing; the timing runs once
per process for each head geometry and torch thread count (what it depends on), as the decode
attention's does (`engine.kernels.attention_choice`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine.kernels.kernel_choice import best_of_interleaved
from engine.kernels.native_prefill import HEAD_DIMS, load, native_prefill_attention

log = logging.getLogger(__name__)

TIMED_TOKENS = 512  # a typical prefill chunk; the kernel's deficit, where it has one, grows with length
MARGIN = 0.05

#: the choices made in this process: (heads, kv_heads, head_dim, torch threads) → choice
_REMEMBERED: dict[tuple[int, int, int, int], PrefillChoice] = {}


@dataclass(frozen=True)
class PrefillChoice:
    native: bool  # fp32 chunks the kernel takes run there; SDPA otherwise
    ms: Mapping[str, float] = field(default_factory=dict)  # {"native", "sdpa"}: one timed chunk; empty: not timed
    reason: str = ""  # why it was not timed

    def summary(self) -> str:
        name = "native" if self.native else "sdpa"
        if not self.ms:
            return f"{name} ({self.reason})"
        return f"{name} (ms per {TIMED_TOKENS}-token chunk: " + ", ".join(
            f"{k} {v:.2f}" for k, v in sorted(self.ms.items())) + ")"


def pick(ms: Mapping[str, float], margin: float = MARGIN) -> bool:
    """True (the kernel) when it took at most ``1 - margin`` of SDPA's time."""
    return ms["native"] <= (1.0 - margin) * ms["sdpa"]


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def choose_prefill_attention(heads: int, kv_heads: int, head_dim: int, repeats: int = 3) -> PrefillChoice:
    """Time the kernel against SDPA on one fp32 chunk of this head geometry (see the module docstring)."""
    if head_dim not in HEAD_DIMS:
        return PrefillChoice(False, reason=f"the kernel takes head dims {HEAD_DIMS}, not {head_dim}")
    if load() is None:
        return PrefillChoice(False, reason="the C++ kernel does not build here")
    gen = torch.Generator().manual_seed(0)
    s, scale = TIMED_TOKENS, head_dim**-0.5
    q = torch.randn(s, heads, head_dim, generator=gen)  # [S, H, D]
    k = torch.randn(s, kv_heads, head_dim, generator=gen)  # [S, KV, D]
    v = torch.randn(s, kv_heads, head_dim, generator=gen)
    qh, kh, vh = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, heads, S, D]

    def sdpa() -> float:
        return _timed(lambda: F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale,
                                                             enable_gqa=True))

    def native() -> float:
        return _timed(lambda: native_prefill_attention(q, k, v, 0, scale))

    ms = best_of_interleaved({"native": native, "sdpa": sdpa}, repeats)
    choice = PrefillChoice(pick(ms), ms)
    log.info("prefill attention for %d/%d heads of %d: %s", heads, kv_heads, head_dim, choice.summary())
    return choice


def remembered_prefill_attention(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> PrefillChoice:
    """`choose_prefill_attention` once per process for each head geometry and thread count; a dtype
    other than fp32 gets SDPA untimed (the kernel is fp32 only)."""
    if dtype != torch.float32:
        return PrefillChoice(False, reason=f"the kernel is fp32 only, the model runs {dtype}")
    key = (heads, kv_heads, head_dim, torch.get_num_threads())
    if key not in _REMEMBERED:
        _REMEMBERED[key] = choose_prefill_attention(heads, kv_heads, head_dim)
    return _REMEMBERED[key]
