"""The floors the GPU check's timings are read against: bytes a decode step must move, FLOPs a
prefill must do, the card's nominal figures and the two probes that measure its real ones.

Owns: `NOMINAL` (vendor datasheet figures per card: HBM bandwidth and dense bf16 tensor-core peak,
no sparsity) and `nominal_for`, `decode_bytes` / `decode_floor_s` (the memory floor of one decode
step), `prefill_flops` / `prefill_floor_s` (the compute floor of one prefill), `timed_median_s`
(a device-synchronised median), `copy_bandwidth_gbs` and `matmul_peak_tflops` (the probes).

Invariants: the arithmetic is pure (unit-tested on CPU); a floor is a lower bound, so a measured
time under it means the arithmetic or the timer is wrong, never a fast card. A card the table does
not name has no nominal figures (None), never a guessed one. The probes synchronise the device
around every timed call, so they time the device's work, not the launches.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.model.config import ModelConfig


@dataclass(frozen=True)
class Nominal:
    """A card's datasheet figures."""

    card: str
    hbm_gbs: float  # memory bandwidth, GB/s (1e9 bytes)
    bf16_tflops: float  # dense bf16 tensor-core peak, TFLOP/s


#: lower-case substring of `torch.cuda.get_device_name` → figures; the first match wins, so the
#: specific variants come before the plain name (a plain "H100 80GB HBM3" is the SXM card).
NOMINAL: tuple[tuple[str, Nominal], ...] = (
    ("h200 nvl", Nominal("H200 NVL", 4800.0, 835.0)),
    ("h200", Nominal("H200 SXM", 4800.0, 989.0)),
    ("h100 nvl", Nominal("H100 NVL", 3900.0, 835.0)),
    ("h100 pcie", Nominal("H100 PCIe", 2000.0, 756.0)),
    ("h100", Nominal("H100 SXM", 3350.0, 989.0)),
    ("a100-sxm4-80gb", Nominal("A100 SXM4 80GB", 2039.0, 312.0)),
    ("a100 80gb pcie", Nominal("A100 PCIe 80GB", 1935.0, 312.0)),
    ("a100", Nominal("A100 40GB", 1555.0, 312.0)),
    ("l40s", Nominal("L40S", 864.0, 362.0)),
    ("l4", Nominal("L4", 300.0, 121.0)),
)


def nominal_for(device_name: str) -> Nominal | None:
    name = device_name.lower()
    return next((fig for key, fig in NOMINAL if key in name), None)


def decode_weight_bytes(cfg: ModelConfig, dtype_bytes: int) -> int:
    """Weight bytes one decode step reads: every linear layer, the norms and the LM head (the
    embedding is a gather of B rows: not counted; a tied head is the embedding, read once)."""
    h, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    per_layer = (q + 2 * kv) * h + h * q + 2 * inter * h + h * inter + 2 * h
    return (cfg.num_layers * per_layer + cfg.vocab_size * h + h) * dtype_bytes


def decode_bytes(cfg: ModelConfig, dtype: torch.dtype, context_lens: Sequence[int]) -> int:
    """Bytes one decode step must move: the weights once, every row's cached K and V (positions
    before its new token) read, the new token's K and V written."""
    size = torch.finfo(dtype).bits // 8
    per_token = cfg.kv_bytes_per_token(dtype)
    return decode_weight_bytes(cfg, size) + sum(n - 1 for n in context_lens) * per_token + len(context_lens) * per_token


def decode_floor_s(nbytes: int, bandwidth_gbs: float) -> float:
    return nbytes / (bandwidth_gbs * 1e9)


def prefill_flops(cfg: ModelConfig, n_tokens: int) -> int:
    """FLOPs of one causal prefill of ``n_tokens`` fresh tokens: the linear layers for every token,
    attention over the causal triangle (q·k and p·v: ``2 * q_size * T * (T + 1)`` per layer) and
    the LM head for the last token only."""
    h, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    linear = (q + 2 * kv) * h + h * q + 3 * inter * h  # multiply-adds per token per layer
    per_layer = 2 * linear * n_tokens + 2 * q * n_tokens * (n_tokens + 1)
    return cfg.num_layers * per_layer + 2 * cfg.vocab_size * h


def prefill_floor_s(flops: int, tflops: float) -> float:
    return flops / (tflops * 1e12)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_median_s(fn: Callable[[], object], device: torch.device, repeats: int, warmup: int) -> float:
    """Median wall time of ``fn`` over ``repeats`` calls after ``warmup``, the device synchronised
    before and after each call."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth_gbs(device: torch.device, nbytes: int, repeats: int = 10) -> float:
    """Device memory bandwidth from a large copy (each copy reads and writes ``nbytes``)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    t = timed_median_s(lambda: dst.copy_(src), device, repeats, warmup=2)
    return 2 * nbytes / t / 1e9


def matmul_peak_tflops(device: torch.device, n: int, dtype: torch.dtype = torch.bfloat16,
                       repeats: int = 10) -> float:
    """Achieved TFLOP/s of one ``[n, n] @ [n, n]`` matmul in ``dtype``."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    t = timed_median_s(lambda: a @ b, device, repeats, warmup=3)
    return 2 * n**3 / t / 1e12
