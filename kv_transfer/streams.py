"""Layer streams: the staging-mode data flow, one layer at a time through a small ring of buffers.

Wire format (staging mode: gloo, local): a transfer of ``n`` blocks is cut into chunks of ``g``
consecutive layers, chunk ``i`` = layers ``i*g .. i*g+g-1``, K and V, of the blocks:
``[g, 2, n, block_size, kv_heads, head_dim]``, in order. ``g`` is the largest divisor of
``num_layers`` whose chunk stays within `CHUNK_BYTES` (so small transfers are not latency-bound by
one op per layer; large ones go a layer at a time); both ends derive it from the layout and ``n``.
The source gathers chunk ``i`` into ring slot ``i % window`` right before it is sent; the
destination scatters chunk ``i`` out of its slot right after it arrives. So gathering, the wire
and scattering overlap (on gloo, whose ops are asynchronous), and buffers are small and reused:
fresh multi-hundred-MB allocations cost more than the copies themselves (page faults).

Invariants:
- `ScatterStream` is the only writer of the destination's blocks in staging mode, and after
  `cancel` returns it never writes again (a drain in progress finishes first), so a failed or
  cancelled pull has stopped touching blocks before `KVPuller.pull` returns.
- `GatherStream` only reads blocks while its transfer is in flight; `cancel` stops it the same way.
- Ring buffers return to the `BufferPool` only after a stream completed; after a failure the data
  plane may still hold them (posted receives), so they are dropped with the pair.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence

import torch

from engine.kv_cache import KVCache
from kv_transfer.blocks import sync_device
from kv_transfer.errors import TransferError

#: Ring slots per stream. Part of the wire protocol for transports without asynchronous ops (their
#: `KVTransport.send_stream` default sends a window per call, which the receiver must mirror).
STREAM_WINDOW = 4
#: Target size of one chunk (see the wire format above): also part of the protocol.
CHUNK_BYTES = 1 << 20


def layers_per_chunk(num_layers: int, layer_nbytes: int) -> int:
    """Largest divisor of ``num_layers`` whose chunk fits `CHUNK_BYTES` (at least 1)."""
    fits = [d for d in range(1, num_layers + 1) if num_layers % d == 0 and d * layer_nbytes <= CHUNK_BYTES]
    return max(fits, default=1)


def size_class(nbytes: int) -> int:
    """The buffer size `BufferPool` hands out for ``nbytes``: the next power of two, at least 64 KiB."""
    return max(_MIN_CLASS_BYTES, 1 << max(0, nbytes - 1).bit_length())


_MIN_CLASS_BYTES = 64 << 10


class BufferPool:
    """Free flat buffers by (size class, dtype, device), reused across transfers; holds at most ``max_bytes``.

    A transfer's ring slot is a view of a flat buffer of the next power-of-two size, so transfers of
    different lengths reuse the same buffers (keyed by exact shape, every prompt length would leave
    buffers of its own behind, and the process's memory would creep with the mix of lengths).
    """

    def __init__(self, max_bytes: int = 64 << 20) -> None:
        self.max_bytes = max_bytes
        self._free: dict[tuple[int, torch.dtype, str], list[torch.Tensor]] = {}
        self._held = 0
        self._lock = threading.Lock()

    def take(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, n: int) -> list[torch.Tensor]:
        numel = math.prod(shape)
        itemsize = dtype.itemsize
        cls = size_class(numel * itemsize)
        key = (cls, dtype, str(device))
        with self._lock:
            got = self._free.get(key, [])[:n]
            if got:
                self._free[key] = self._free[key][len(got):]
                self._held -= cls * len(got)
        bases = got + [torch.empty(cls // itemsize, dtype=dtype, device=device) for _ in range(n - len(got))]
        return [b[:numel].view(shape) for b in bases]

    def give(self, tensors: Sequence[torch.Tensor]) -> None:
        with self._lock:
            for t in tensors:
                base = t._base if t._base is not None else t
                ours = base.dim() == 1 and base.nbytes == size_class(base.nbytes)
                if not ours or self._held + base.nbytes > self.max_bytes:
                    continue  # not one of ours, or over budget: let it go (its memory returns to the allocator)
                self._free.setdefault((base.nbytes, base.dtype, str(base.device)), []).append(base)
                self._held += base.nbytes

    @property
    def held_bytes(self) -> int:
        with self._lock:
            return self._held


class _LayerStream:
    """Chunks of ``[g, 2, n, bs, H, D]`` (``g`` layers) through ``window`` slots; see the module doc."""

    def __init__(self, cache: KVCache, block_ids: Sequence[int], pool: BufferPool,
                 window: int = STREAM_WINDOW) -> None:
        self.cache = cache
        layer_nbytes = len(block_ids) * cache.block_nbytes // cache.num_layers  # K and V of one layer
        self.group = layers_per_chunk(cache.num_layers, layer_nbytes)
        self.count = cache.num_layers // self.group
        self.window = min(window, self.count)
        self._idx = torch.tensor(list(block_ids), dtype=torch.long, device=cache.device)
        self._pool = pool
        shape = (self.group, 2, len(block_ids), *cache.block_shape)
        self._slots = pool.take(shape, cache.dtype, cache.device, self.window)
        self._lock = threading.Lock()  # held while touching the cache; `cancel` waits on it
        self._cancelled = False
        self._completed = False

    def buffer(self, i: int) -> torch.Tensor:
        return self._slots[i % self.window]

    @property
    def chunk_nbytes(self) -> int:
        return self._slots[0].nbytes

    def cancel(self) -> None:
        """Stop for good; returns once no cache access is in progress (at most one layer's copy)."""
        with self._lock:
            self._cancelled = True

    def complete(self) -> None:
        """The data plane is done with every slot: they go back to the pool."""
        self._completed = True
        self._pool.give(self._slots)
        self._slots = []

    def _check(self) -> None:
        if self._cancelled:
            raise TransferError("stream cancelled")


class GatherStream(_LayerStream):
    """Source side: `fill` copies chunk ``i``'s layers of the blocks into its slot."""

    def fill(self, i: int) -> None:
        with self._lock:
            self._check()
            buf = self.buffer(i)  # [g, 2, n, bs, H, D]
            for j in range(self.group):
                layer = i * self.group + j
                torch.index_select(self.cache.k[layer], 0, self._idx, out=buf[j, 0])
                torch.index_select(self.cache.v[layer], 0, self._idx, out=buf[j, 1])
            sync_device(buf)


class ScatterStream(_LayerStream):
    """Destination side: `drain` copies chunk ``i``'s layers out of its slot into the blocks."""

    def drain(self, i: int) -> None:
        with self._lock:
            self._check()
            buf = self.buffer(i)  # [g, 2, n, bs, H, D]
            for j in range(self.group):
                layer = i * self.group + j
                self.cache.k[layer].index_copy_(0, self._idx, buf[j, 0])
                self.cache.v[layer].index_copy_(0, self._idx, buf[j, 1])
            sync_device(self.cache.k[0])
