"""`StagingPool`: the staging memory of one replica's transfers, bounded and counted.

Owns every staging buffer a replica's layer streams use (`streams.py`), on the cache's device: the
buffers lent to transfers in flight and the idle ones kept for reuse. Their sum never exceeds
``max_bytes`` (`KVTransferConfig.max_inflight_bytes`), so the engine's KV budget can hold exactly
that much back for transfers. A stream asks for up to ``n`` buffers of one size; it gets at least
one as soon as the budget allows (idle buffers of another size are dropped to make room), waits
while other transfers hold the budget, and gives up at its deadline or when it is cancelled.

Why a pool: fresh multi-hundred-MB allocations cost more than the copies themselves (page faults
on a host, allocator churn on a device), and keyed by exact shape every prompt length would leave
buffers of its own behind. A buffer is flat, of a power-of-two size class (`size_class`), so
transfers of different lengths reuse the same buffers.

Invariants: ``lent_bytes + idle_bytes <= max_bytes`` at all times (``peak_bytes`` records the
largest sum seen); a buffer given back after a failure is dropped, never reused (the data plane of
the failed pair may still reference it); `take` never blocks past its deadline.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import torch

from kv_transfer.errors import TransferError, TransferTimeout

_MIN_CLASS_BYTES = 64 << 10
_WAIT_SLICE_S = 0.05  # how often a waiting `take` looks at its cancel flag


def size_class(nbytes: int) -> int:
    """The buffer size `StagingPool` hands out for ``nbytes``: the next power of two, at least 64 KiB."""
    return max(_MIN_CLASS_BYTES, 1 << max(0, nbytes - 1).bit_length())


class StagingPool:
    """Flat staging buffers by (size class, dtype, device); lent + idle bytes stay within ``max_bytes``."""

    def __init__(self, max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ValueError(f"max_inflight_bytes must be positive, got {max_bytes}")
        self.max_bytes = max_bytes
        self._idle: dict[tuple[int, torch.dtype, str], list[torch.Tensor]] = {}
        self._lent = 0
        self._held = 0  # idle bytes
        self._peak = 0
        self._cv = threading.Condition()

    def take(self, nbytes: int, n: int, dtype: torch.dtype, device: torch.device, timeout_s: float,
             cancelled: Callable[[], bool] = lambda: False) -> list[torch.Tensor]:
        """Between 1 and ``n`` flat buffers of at least ``nbytes`` each; waits while the budget is held."""
        cls = size_class(nbytes)
        if cls > self.max_bytes:
            raise TransferError(f"a staging buffer of {cls} bytes does not fit max_inflight_bytes="
                                f"{self.max_bytes}")
        key = (cls, dtype, str(device))
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while True:
                if cancelled():
                    raise TransferError("stream cancelled while waiting for staging memory")
                reused, fresh = self._reserve(key, n)
                if reused or fresh:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransferTimeout(f"no staging memory within {timeout_s:.1f}s: "
                                          f"{self._lent} of max_inflight_bytes={self.max_bytes} are in flight")
                self._cv.wait(min(left, _WAIT_SLICE_S))
        try:
            made = [torch.empty(cls // dtype.itemsize, dtype=dtype, device=device) for _ in range(fresh)]
        except BaseException:
            with self._cv:
                self._lent -= cls * fresh
                self._cv.notify_all()
            raise
        return reused + made

    def _reserve(self, key: tuple[int, torch.dtype, str], n: int) -> tuple[list[torch.Tensor], int]:
        """Lend idle buffers of ``key``, then count fresh ones while the budget allows (lock held)."""
        cls = key[0]
        idle = self._idle.get(key, [])
        reused, self._idle[key] = idle[:n], idle[n:]
        self._held -= cls * len(reused)
        self._lent += cls * len(reused)
        fresh = 0
        while len(reused) + fresh < n:
            if self._lent + self._held + cls > self.max_bytes and not self._evict(cls):
                break
            fresh += 1
            self._lent += cls
        self._peak = max(self._peak, self._lent + self._held)
        return reused, fresh

    def _evict(self, need: int) -> bool:
        """Drop idle buffers until ``need`` more bytes fit (lock held); False if they cannot."""
        if self._lent + need > self.max_bytes:
            return False
        for bufs in self._idle.values():
            while bufs and self._lent + self._held + need > self.max_bytes:
                self._held -= bufs.pop().nbytes
        return True

    def give(self, buffers: Sequence[torch.Tensor], reuse: bool = True) -> None:
        """Return buffers from `take`; ``reuse=False`` (after a failure) drops them instead of keeping them."""
        with self._cv:
            for buf in buffers:
                self._lent -= buf.nbytes
                if reuse:
                    self._idle.setdefault((buf.nbytes, buf.dtype, str(buf.device)), []).append(buf)
                    self._held += buf.nbytes
            self._cv.notify_all()

    @property
    def lent_bytes(self) -> int:
        with self._cv:
            return self._lent

    @property
    def held_bytes(self) -> int:
        """Idle bytes kept for reuse (counted against ``max_bytes`` too)."""
        with self._cv:
            return self._held

    @property
    def peak_bytes(self) -> int:
        with self._cv:
            return self._peak
