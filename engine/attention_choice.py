"""Which formulation of batched fp32 decode attention this machine runs fastest, measured at load.

Owns: the choice among `attention.DECODE_METHODS` for decode steps of more than one sequence in
fp32 (and the small bf16 steps, which run in fp32), and the timings behind it. Why measure: the
fastest formulation differs between CPUs of the same kind of machine. At 32 sequences x 1,040
positions (SmolLM2's 9 heads over 3 KV heads) a layer took, on a 2-core Xeon, per_head 2.9 ms vs
sdpa 5.5; on a 2-core AVX-512 EPYC, sdpa 6.8, block_diagonal 8.1, per_head 11.6 (torch 2.13).

How: every method runs on the same synthetic fp32 K/V buffers of the model's head geometry at a
short and a long step (`SIZES`, the batch halved until one buffer fits `MAX_BUFFER_BYTES`), methods
interleaved, best of ``repeats``; the method with the lowest geometric mean over the sizes wins.

Invariants: every method computes the same attention up to float reassociation (tested against
the reference `attention.decode_attention`), so the choice changes speed only; a pinned method is
never timed; off-CPU devices are not timed here (no sync point in the loop) and get ``"sdpa"``.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from engine.attention import DECODE_METHODS, Workspace, batched_decode_attention

DECODE_ATTENTION = ("auto", *DECODE_METHODS)
SIZES = ((8, 272), (32, 1040))  # (sequences, positions) of the timed steps
MAX_BUFFER_BYTES = 64 * 2**20


@dataclass(frozen=True)
class AttentionChoice:
    """The method batched fp32 decode steps use, and its timings (empty when pinned)."""

    method: str
    ms: dict[str, dict[str, float]] = field(default_factory=dict)  # method → "BxL" → best ms of one call

    def summary(self) -> str:
        if not self.ms:
            return self.method
        times = ", ".join(f"{m} " + "/".join(f"{t:.2f}" for t in by.values()) for m, by in self.ms.items())
        return f"{self.method} (ms at {'/'.join(next(iter(self.ms.values())))}: {times})"


def time_methods(num_heads: int, num_kv_heads: int, head_dim: int, repeats: int = 3
                 ) -> dict[str, dict[str, float]]:
    """Best-of-``repeats`` milliseconds of one attention call per method and size."""
    g = torch.Generator().manual_seed(0)
    ws = Workspace()
    ms: dict[str, dict[str, float]] = {m: {} for m in DECODE_METHODS}
    for batch, length in SIZES:
        while batch > 2 and batch * length * num_kv_heads * head_dim * 4 > MAX_BUFFER_BYTES:
            batch //= 2
        q = torch.randn(batch, num_heads, head_dim, generator=g)  # [B, H, D]
        k = torch.randn(batch, length, num_kv_heads, head_dim, generator=g)  # [B, L, KV, D]
        v = torch.randn(batch, length, num_kv_heads, head_dim, generator=g)
        bias = torch.zeros(batch, 1, length)  # [B, 1, L]
        bias[1:, :, length // 2 :] = float("-inf")  # padded rows, as in a step of mixed lengths
        best = {m: float("inf") for m in DECODE_METHODS}
        with torch.inference_mode():
            for m in DECODE_METHODS:  # warm-up
                batched_decode_attention(q, k, v, bias, head_dim**-0.5, m, ws)
            for _ in range(repeats):
                for m in DECODE_METHODS:
                    t0 = time.perf_counter()
                    batched_decode_attention(q, k, v, bias, head_dim**-0.5, m, ws)
                    best[m] = min(best[m], (time.perf_counter() - t0) * 1e3)
        for m in DECODE_METHODS:
            ms[m][f"{batch}x{length}"] = best[m]
    return ms


def choose_decode_attention(num_heads: int, num_kv_heads: int, head_dim: int, mode: str = "auto",
                            device: torch.device | str = "cpu") -> AttentionChoice:
    """``mode`` pins a method; ``"auto"`` times them (`time_methods`) on CPU."""
    if mode not in DECODE_ATTENTION:
        raise ValueError(f"unknown decode_attention {mode!r}; expected one of {DECODE_ATTENTION}")
    if mode != "auto":
        return AttentionChoice(mode)
    if torch.device(device).type != "cpu":
        return AttentionChoice("sdpa")
    ms = time_methods(num_heads, num_kv_heads, head_dim)
    score = {m: math.prod(by.values()) ** (1.0 / len(by)) for m, by in ms.items()}
    return AttentionChoice(min(score, key=score.__getitem__), ms)
