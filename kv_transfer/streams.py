"""Layer streams: the staging-mode data flow, a few layers at a time through a small ring of buffers.

Wire format (every transport but ``local-direct``): a transfer of ``n`` blocks travels as a list of
chunks in order (`plan_chunks`), each ``[g, 2, nb, block_size, kv_heads, head_dim]``: K and V of
``g`` consecutive layers for ``nb`` consecutive blocks of the transfer's block list.

- small layers: ``g`` = the largest divisor of ``num_layers`` whose chunk fits `CHUNK_BYTES`, all
  ``n`` blocks (small transfers are not latency-bound by one op per layer);
- one layer per chunk once a layer exceeds `CHUNK_BYTES`;
- a layer over `MAX_CHUNK_BYTES` goes in slices of at most that many bytes.

Both ends derive the plan from the layout and ``n`` alone, so the number of ops on the wire is
``num_layers`` times the slices per layer, whatever the order or fragmentation of either side's
block ids: the source gathers a chunk with ``index_select`` into a ring slot right before it is
sent, the destination scatters it with ``index_copy_`` right after it arrives. Gathering, the wire
and scattering overlap on transports with asynchronous ops (gloo, nccl).

Staging memory: a stream's ring slots come from the replica's `StagingPool` (`reserve`, in the
worker thread, bounded by the transfer's deadline) and go back when the transfer ends (`finish`);
a stream gets fewer slots than `STREAM_WINDOW` when the pool is short, at least one. The window is
each side's own choice: transports match chunks by their index, never by window.

Invariants:
- `ScatterStream` is the only writer of the destination's blocks in staging mode, and after
  `cancel` returns it never writes again (a drain in progress finishes first), so a failed or
  cancelled pull has stopped touching blocks before `KVPuller.pull` returns.
- `GatherStream` only reads blocks while its transfer is in flight; `cancel` stops it the same way.
- Slots go back for reuse only after the transfer completed; after a failure they are dropped
  (the failed pair's data plane may still hold them), their bytes no longer counted.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.kv_cache import KVCache
from kv_transfer.blocks import sync_device
from kv_transfer.errors import TransferError
from kv_transfer.staging import StagingPool, size_class

#: Most ring slots per stream.
STREAM_WINDOW = 4
#: Chunks of small layers group layers up to this size: part of the wire format.
CHUNK_BYTES = 1 << 20
#: Largest chunk: a layer bigger than this travels in block slices. Part of the wire format; also
#: the least staging memory (`KVTransferConfig.max_inflight_bytes`) a replica can work with.
MAX_CHUNK_BYTES = 16 << 20


def min_inflight_bytes() -> int:
    """The smallest staging budget every transfer fits (one slot of the largest chunk)."""
    return size_class(MAX_CHUNK_BYTES)


def layers_per_chunk(num_layers: int, layer_nbytes: int) -> int:
    """Largest divisor of ``num_layers`` whose chunk fits `CHUNK_BYTES` (at least 1)."""
    limit = min(CHUNK_BYTES, MAX_CHUNK_BYTES)
    fits = [d for d in range(1, num_layers + 1) if num_layers % d == 0 and d * layer_nbytes <= limit]
    return max(fits, default=1)


@dataclass(frozen=True)
class Chunk:
    """Layers ``layer .. layer + layers - 1``, blocks ``block .. block + blocks - 1`` of the transfer."""

    layer: int
    layers: int
    block: int
    blocks: int


def plan_chunks(num_layers: int, n_blocks: int, block_layer_nbytes: int) -> list[Chunk]:
    """The wire order of a transfer (see the module doc); ``block_layer_nbytes``: K+V of one block, one layer."""
    layer_nbytes = n_blocks * block_layer_nbytes
    if layer_nbytes <= MAX_CHUNK_BYTES:
        g = layers_per_chunk(num_layers, layer_nbytes)
        return [Chunk(first, g, 0, n_blocks) for first in range(0, num_layers, g)]
    per_slice = max(1, MAX_CHUNK_BYTES // block_layer_nbytes)
    return [Chunk(layer, 1, b, min(per_slice, n_blocks - b))
            for layer in range(num_layers) for b in range(0, n_blocks, per_slice)]


class _LayerStream:
    """The chunks of `plan_chunks` through up to ``window`` ring slots; see the module doc."""

    def __init__(self, cache: KVCache, block_ids: Sequence[int], pool: StagingPool,
                 window: int = STREAM_WINDOW) -> None:
        self.cache = cache
        self.chunks = plan_chunks(cache.num_layers, len(block_ids), cache.block_nbytes // cache.num_layers)
        self.count = len(self.chunks)
        self.window = min(window, self.count)  # lowered by `reserve` when the pool is short
        self._idx = torch.tensor(list(block_ids), dtype=torch.long, device=cache.device)
        self._block_numel = math.prod(cache.block_shape)
        self._pool = pool
        self._slots: list[torch.Tensor] = []
        self._lock = threading.Lock()  # held while touching the cache; `cancel` waits on it
        self._cancelled = False

    @property
    def chunk_nbytes(self) -> int:
        """Bytes of the largest chunk: the size of one ring slot."""
        return max(self._numel(c) for c in self.chunks) * self.cache.dtype.itemsize

    def _numel(self, c: Chunk) -> int:
        return c.layers * 2 * c.blocks * self._block_numel

    def reserve(self, timeout_s: float) -> None:
        """Take the ring slots from the pool (worker thread): at least one, waiting up to ``timeout_s``."""
        if self._slots:
            return
        deadline = time.monotonic() + timeout_s
        self._slots = self._pool.take(self.chunk_nbytes, self.window, self.cache.dtype, self.cache.device,
                                      timeout_s, cancelled=lambda: self._cancelled)
        self.window = len(self._slots)
        if time.monotonic() > deadline:
            self.finish(ok=True)
            raise TransferError("stream: no time left after waiting for staging memory")

    def buffer(self, i: int) -> torch.Tensor:
        c = self.chunks[i]
        flat = self._slots[i % self.window]
        return flat[:self._numel(c)].view(c.layers, 2, c.blocks, *self.cache.block_shape)

    def indices(self, c: Chunk) -> torch.Tensor:
        return self._idx[c.block:c.block + c.blocks]

    def cancel(self) -> None:
        """Stop for good; returns once no cache access is in progress (at most one chunk's copy)."""
        with self._lock:
            self._cancelled = True

    def finish(self, ok: bool) -> None:
        """The data plane is done with every slot: back to the pool, for reuse only if ``ok``."""
        slots, self._slots = self._slots, []
        self._pool.give(slots, reuse=ok)

    def complete(self) -> None:
        self.finish(ok=True)

    def _check(self) -> None:
        if self._cancelled:
            raise TransferError("stream cancelled")


class GatherStream(_LayerStream):
    """Source side: `fill` copies chunk ``i``'s layers of its blocks into its slot."""

    def fill(self, i: int) -> None:
        with self._lock:
            self._check()
            c, buf = self.chunks[i], self.buffer(i)  # buf: [g, 2, nb, bs, H, D]
            idx = self.indices(c)
            for j in range(c.layers):
                torch.index_select(self.cache.k[c.layer + j], 0, idx, out=buf[j, 0])
                torch.index_select(self.cache.v[c.layer + j], 0, idx, out=buf[j, 1])
            sync_device(buf)


class ScatterStream(_LayerStream):
    """Destination side: `drain` copies chunk ``i`` out of its slot into the blocks."""

    def drain(self, i: int) -> None:
        with self._lock:
            self._check()
            c, buf = self.chunks[i], self.buffer(i)  # buf: [g, 2, nb, bs, H, D]
            idx = self.indices(c)
            for j in range(c.layers):
                self.cache.k[c.layer + j].index_copy_(0, idx, buf[j, 0])
                self.cache.v[c.layer + j].index_copy_(0, idx, buf[j, 1])
            sync_device(self.cache.k[0])
