"""Measure this machine's limits in the same run as a benchmark: matmul peak and read bandwidth.

Every roofline ratio we quote divides by numbers measured here, seconds before, on the same cores.
"""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine.kernels.native_linear import NativeLinear, native_linear_error
from engine.kernels.quant import Linear, onednn_packing_available


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
    """The fastest of ``torch.mm``, ``F.linear``, oneDNN's inner product on a prepacked weight (where
    this torch has it) and, for bf16, ``F.linear`` in fp32 after upcasting both operands (the engine's
    `engine.kernels.quant.UpcastLinear`, conversion included) for an ``n``-cube. On a 2-core AVX-512 EPYC
    torch.mm's fp32 BLAS ran at half of oneDNN (99 vs 207 GFLOP/s), so torch.mm alone made the
    engine's prefill look above the peak; on an AVX2 EPYC (no bf16 arithmetic) torch.mm in bf16 ran
    at 0.75 GFLOP/s, F.linear at ~18 and the upcast at ~140."""
    a = torch.randn(n, n, dtype=torch.float32).to(dtype)
    b = torch.randn(n, n, dtype=torch.float32).to(dtype)
    best = min(median_time(lambda: torch.mm(a, b)), median_time(lambda: F.linear(a, b)))
    if onednn_packing_available(dtype):
        packed = torch.ops.mkldnn._reorder_linear_weight(b, n)  # computes a @ b.T: same FLOPs
        best = min(best, median_time(lambda: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], "")))
    if dtype == torch.bfloat16:
        best = min(best, median_time(lambda: F.linear(a.float(), b.float()).to(dtype)))
    return 2 * n**3 / best / 1e9


def read_bandwidth_gbs(nbytes: int = 512 * 2**20) -> float:
    """Plain streaming read: sum of a large fp32 tensor."""
    x = torch.ones(nbytes // 4, dtype=torch.float32)
    t = median_time(lambda: x.sum())
    return nbytes / t / 1e9


class MatvecProbe:
    """A large matrix-vector product (the decode shape) kept allocated, so that a benchmark can time
    it between its own steps: the bandwidth a ratio divides by is then measured under the same load
    as the steps, not minutes before (the hosts are shared and their bandwidth drifts).

    Two kernels read the matrix: ``F.linear`` and the engine's own C++ one (`engine.kernels.native_linear`,
    where it builds); a call times both and returns the faster, so the floor is the best read of
    this machine we know, not one library's (on a 2-core AVX2 EPYC: 19-22 GB/s for torch, 33 for ours).
    ``last`` keeps each kernel's seconds from the latest call."""

    def __init__(self, dtype: torch.dtype, rows: int = 16384, cols: int = 8192) -> None:
        self.w = torch.randn(rows, cols, dtype=torch.float32).to(dtype)  # [rows, cols], far above any cache
        self.v = torch.randn(1, cols, dtype=torch.float32).to(dtype)  # [1, cols]
        self.nbytes = self.w.numel() * self.w.element_size()
        self.kernels: dict[str, Callable[[], object]] = {"torch": lambda: F.linear(self.v, self.w)}
        if native_linear_error() is None:
            native = NativeLinear(Linear(self.w))
            self.kernels["native"] = lambda: native(self.v)
        self.last: dict[str, float] = {}

    def __call__(self) -> float:
        """Seconds of one product by the faster kernel (each timed once, in turn)."""
        for name, kernel in self.kernels.items():
            t0 = time.perf_counter()
            kernel()
            self.last[name] = time.perf_counter() - t0
        return min(self.last.values())


def matvec_bandwidth_gbs(dtype: torch.dtype, rows: int = 16384, cols: int = 8192,
                         by_kernel: dict[str, float] | None = None) -> float:
    """Bytes of a large weight matrix read per second by a matrix-vector product (the decode shape),
    the faster kernel's (median of calls); ``by_kernel`` (if given) receives each kernel's GB/s."""
    probe = MatvecProbe(dtype, rows, cols)
    seen: dict[str, list[float]] = {}

    def call() -> float:
        t = probe()
        for name, s in probe.last.items():
            seen.setdefault(name, []).append(s)
        return t

    t = median_time(call)
    if by_kernel is not None:
        by_kernel.update({name: probe.nbytes / statistics.median(v) / 1e9 for name, v in seen.items()})
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
    by: dict[str, dict[str, float]] = {"fp32": {}, "bf16": {}}
    out = {
        "matmul_fp32_gflops": matmul_peak_gflops(torch.float32),
        "matmul_bf16_gflops": matmul_peak_gflops(torch.bfloat16),
        "read_gbs": read_bandwidth_gbs(),
        "matvec_fp32_gbs": matvec_bandwidth_gbs(torch.float32, by_kernel=by["fp32"]),
        "matvec_bf16_gbs": matvec_bandwidth_gbs(torch.bfloat16, by_kernel=by["bf16"]),
    }
    for dt, kernels in by.items():
        out.update({f"matvec_{dt}_{name}_gbs": gbs for name, gbs in kernels.items()})
    return out
