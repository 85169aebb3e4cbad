"""Measure this machine's limits in the same run as a benchmark: matmul peak and read bandwidth.

Every roofline ratio we quote divides by numbers measured here, seconds before, on the same cores.
"""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable

import torch

from engine.quant import onednn_packing_available


def median_time(fn: Callable[[], object], repeats: int = 7, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def matmul_peak_gflops(dtype: torch.dtype, n: int = 1536) -> float:
    """The faster of ``torch.mm`` and oneDNN's inner product on a prepacked weight (where this torch
    has it) for an ``n``-cube: on a 2-core AVX-512 EPYC torch.mm's fp32 BLAS ran at half of oneDNN
    (99 vs 207 GFLOP/s), so torch.mm alone made the engine's prefill look above the peak."""
    a = torch.randn(n, n, dtype=torch.float32).to(dtype)
    b = torch.randn(n, n, dtype=torch.float32).to(dtype)
    best = median_time(lambda: torch.mm(a, b))
    if onednn_packing_available(dtype):  # else torch.mm is the peak
        packed = torch.ops.mkldnn._reorder_linear_weight(b, n)  # computes a @ b.T: same FLOPs
        best = min(best, median_time(lambda: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], "")))
    return 2 * n**3 / best / 1e9


def read_bandwidth_gbs(nbytes: int = 512 * 2**20) -> float:
    """Plain streaming read: sum of a large fp32 tensor."""
    x = torch.ones(nbytes // 4, dtype=torch.float32)
    t = median_time(lambda: x.sum())
    return nbytes / t / 1e9


class MatvecProbe:
    """A large matrix-vector product (the decode shape) kept allocated, so that a benchmark can time
    it between its own steps: the bandwidth a ratio divides by is then measured under the same load
    as the steps, not minutes before (the hosts are shared and their bandwidth drifts)."""

    def __init__(self, dtype: torch.dtype, rows: int = 16384, cols: int = 8192) -> None:
        self.w = torch.randn(rows, cols, dtype=torch.float32).to(dtype)  # [rows, cols], far above any cache
        self.v = torch.randn(1, cols, dtype=torch.float32).to(dtype)  # [1, cols]
        self.nbytes = self.w.numel() * self.w.element_size()

    def __call__(self) -> float:
        """Seconds of one product."""
        t0 = time.perf_counter()
        torch.nn.functional.linear(self.v, self.w)
        return time.perf_counter() - t0


def matvec_bandwidth_gbs(dtype: torch.dtype, rows: int = 16384, cols: int = 8192) -> float:
    """Bytes of a large weight matrix read per second by a matrix-vector product (the decode shape)."""
    probe = MatvecProbe(dtype, rows, cols)
    t = median_time(probe)
    return probe.nbytes / t / 1e9


def machine_info() -> dict[str, object]:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def measure_limits() -> dict[str, float]:
    return {
        "matmul_fp32_gflops": matmul_peak_gflops(torch.float32),
        "matmul_bf16_gflops": matmul_peak_gflops(torch.bfloat16),
        "read_gbs": read_bandwidth_gbs(),
        "matvec_fp32_gbs": matvec_bandwidth_gbs(torch.float32),
        "matvec_bf16_gbs": matvec_bandwidth_gbs(torch.bfloat16),
    }
