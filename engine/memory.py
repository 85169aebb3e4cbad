"""Device memory as the KV budget sees it: `MemoryReport` and the probes that produce it.

Owns: asking a device how much memory it has and how much is free now (CUDA:
``torch.cuda.mem_get_info``; a CPU: psutil's total and available memory), how much this process holds
there (CUDA: the caching allocator's allocated bytes; a CPU: the process's resident set), and the
peak a call needs beyond that (`MemoryProbe.peak_during`: CUDA's allocator high-water mark). A CPU
probe profiles no peak (``profiles_peak`` false): a CPU step's activations are small beside the
machine's memory and no allocator statistic sees them. psutil is imported by the CPU probe when it
measures, so a CUDA machine without it still sizes its cache.

The probe is a parameter of `Engine.from_dir` (`probe_for` picks the device's), so tests feed a fake
report and exercise the same sizing code a GPU runs.

Invariants: every figure is bytes; a probe never allocates on the device itself; `peak_during`
returns what the call needed beyond what was allocated when it started (never negative).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.errors import missing_dependency

GIB = 1 << 30


def gib(n: float) -> str:
    """``n`` bytes as GiB with one decimal, for messages: ``"15.0 GiB"``."""
    return f"{n / GIB:.1f} GiB"


@dataclass(frozen=True)
class MemoryReport:
    """One look at a device's memory."""

    total: int  # the device's memory
    free: int  # free now, for every process on the device


class MemoryProbe(Protocol):
    """What the KV budget asks a device (see the module docstring)."""

    @property
    def profiles_peak(self) -> bool: ...

    def report(self) -> MemoryReport: ...

    def allocated(self) -> int: ...

    def peak_during(self, fn: Callable[[], object]) -> int: ...


class CudaProbe:
    """A CUDA device, through torch's caching allocator."""

    profiles_peak = True

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def report(self) -> MemoryReport:
        torch.cuda.empty_cache()  # what the allocator caches but holds no tensor in counts as free
        free, total = torch.cuda.mem_get_info(self.device)
        return MemoryReport(total=int(total), free=int(free))

    def allocated(self) -> int:
        return int(torch.cuda.memory_allocated(self.device))

    def peak_during(self, fn: Callable[[], object]) -> int:
        torch.cuda.synchronize(self.device)
        before = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        fn()
        torch.cuda.synchronize(self.device)
        return max(0, int(torch.cuda.max_memory_allocated(self.device)) - int(before))


class HostProbe:
    """A CPU: the machine's memory (psutil); this process's use is its resident set; no peak profile."""

    profiles_peak = False

    def report(self) -> MemoryReport:
        with missing_dependency("psutil", "sizing a KV cache in host memory"):
            import psutil
        vm = psutil.virtual_memory()
        return MemoryReport(total=int(vm.total), free=int(vm.available))

    def allocated(self) -> int:
        with missing_dependency("psutil", "sizing a KV cache in host memory"):
            import psutil
        return int(psutil.Process().memory_info().rss)

    def peak_during(self, fn: Callable[[], object]) -> int:
        fn()
        return 0


def probe_for(device: torch.device) -> MemoryProbe:
    """The probe of ``device``: `CudaProbe` for CUDA, `HostProbe` for a CPU; others are refused by name."""
    if device.type == "cuda":
        return CudaProbe(device)
    if device.type == "cpu":
        return HostProbe()
    raise ValueError(f"no memory probe for device {str(device)!r}; expected 'cpu' or 'cuda'")
