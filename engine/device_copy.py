"""Host values → device tensors without waiting on the device: the one way a step's metadata moves.

Owns: `send` (a host tensor onto a device) and `host_tensor` (a Python list onto a device, built on
the host first).

Why: ``torch.tensor(values, device="cuda")`` and ``t.to("cuda")`` from pageable memory copy
synchronously, so the host waits for every kernel already queued on the stream before it can build
the next step. `send` stages the values in pinned memory and copies with ``non_blocking=True``: the
host goes on at once, and the copy is ordered on the current stream before every kernel queued
after it (torch's caching host allocator keeps the pinned buffer until the copy has run).

Invariants: every host list or host tensor that a step's metadata, a block index or the sampler's
parameters turn into reaches a non-CPU device only through this module. On a CPU `send` returns
its tensor and `host_tensor` is exactly ``torch.tensor(values, dtype=dtype)``: nothing is pinned
and CPU numbers and speed are unchanged.
"""

from __future__ import annotations

from typing import Any

import torch


def send(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """t: a host tensor → the same values on ``device`` (t itself on the CPU), by a pinned
    non-blocking copy on CUDA: the host goes on at once, the stream runs the copy in order."""
    if device.type == "cpu":
        return t
    if device.type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def host_tensor(values: Any, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """values (a list, or nested lists, of numbers) → a ``dtype`` tensor on ``device``, through `send`."""
    return send(torch.tensor(values, dtype=dtype), device)
