"""`HostSwapSpace`: where a preempted sequence's KV blocks wait, in host memory allocated once.

Owns: one host buffer of ``max_swap_blocks`` blocks in the cache's layout
(``[num_layers, 2, max_swap_blocks, block_size, kv_heads, head_dim]``), pinned where the cache is on
CUDA so the copies run without a staging buffer and without blocking the host, plain host memory
on a CPU; and which of its slots each swapped sequence holds.

Why allocated once: preemption happens when the device is short of blocks; a swap that asked for
new memory then (on the device, as a gather into a fresh tensor does) could fail exactly when it is
needed. Here a swap is copies only (`KVCache.gather_blocks` with ``out=``), in runs of consecutive
ids on both sides; slots are handed out lowest first, so a sequence's slots are mostly one run.

Invariants: a slot belongs to at most one sequence; ``num_free + sum of held slots == num_blocks``;
the scheduler's ``max_swap_blocks`` accounting guarantees a swap-out finds its slots, and a shortfall
is an error, never a silent loss. Copies are queued on the device's current stream (the default
stream, in the event loop's thread as in the model thread's): a swap-in, and a swap-out that reuses
its slots later, run in the order they were issued, and so do the copies and any later step that
writes the blocks a swap-out read. Ordering is the stream's alone: nothing here waits on the device,
so a swap may run on the event loop.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import torch

from engine.kv_cache import KVCache


class HostSwapSpace:
    """Host blocks for swapped-out KV, keyed by sequence id."""

    def __init__(self, cache: KVCache, num_blocks: int) -> None:
        pin = cache.device.type == "cuda"
        shape = (cache.num_layers, 2, num_blocks, *cache.block_shape)
        self.buffer = torch.empty(shape, dtype=cache.dtype, device="cpu", pin_memory=pin)  # [L, 2, S, bs, H, D]
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks))  # a heap: the lowest slots first
        self._held: dict[str, list[int]] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def slots_of(self, seq_id: str) -> list[int]:
        """The slots ``seq_id`` holds (empty: none)."""
        return list(self._held.get(seq_id, ()))

    def swap_out(self, seq_id: str, cache: KVCache, block_ids: Sequence[int]) -> None:
        """Copy ``block_ids`` of ``cache`` into free slots held for ``seq_id`` (nothing allocated)."""
        if seq_id in self._held:
            raise ValueError(f"{seq_id} is already swapped out")
        if len(block_ids) > len(self._free):
            raise RuntimeError(f"swap space full: {seq_id} needs {len(block_ids)} blocks, {len(self._free)} of "
                               f"{self.num_blocks} are free (max_swap_blocks)")
        slots = [heapq.heappop(self._free) for _ in block_ids]
        cache.gather_blocks(block_ids, out=self.buffer, slots=slots)
        self._held[seq_id] = slots

    def swap_in(self, seq_id: str, cache: KVCache, block_ids: Sequence[int]) -> None:
        """Copy ``seq_id``'s blocks back into ``block_ids`` of ``cache`` and free its slots."""
        slots = self._held.pop(seq_id, None)
        if slots is None:
            raise KeyError(f"{seq_id} is not swapped out")
        if len(slots) != len(block_ids):
            self._held[seq_id] = slots
            raise ValueError(f"{seq_id} holds {len(slots)} swapped blocks, {len(block_ids)} asked back")
        cache.scatter_blocks(block_ids, self.buffer, slots=slots)
        self._release(slots)

    def release(self, seq_id: str) -> None:
        """Forget ``seq_id``'s swapped blocks, if it has any (a sequence that ended while swapped out)."""
        self._release(self._held.pop(seq_id, []))

    def _release(self, slots: list[int]) -> None:
        for s in slots:
            heapq.heappush(self._free, s)
