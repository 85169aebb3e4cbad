"""The paged KV cache tensors of one process.

Owns: per-layer K and V tensors of shape ``[num_blocks, block_size, kv_heads, head_dim]`` and the
copy helpers that move whole blocks in and out of them (used by the transports and by swap: into
a caller's buffer on any device, in runs of consecutive ids, so a swap to host allocates nothing on
the device).

Invariants: block ``b`` of layer ``l`` is ``k[l][b]`` / ``v[l][b]``; a token at position ``p`` of a
sequence with block table ``bt`` lives at ``bt[p // block_size]``, row ``p % block_size``. The cache
knows nothing of which blocks are in use: that is `engine.block_pool.BlockPool`'s job. Every
layer's K and V are contiguous views of one zeroed buffer, on huge pages where the OS gives them.
The copy helpers never wait on the device: a block index goes over by `engine.device_copy.host_tensor`
(pinned, non-blocking), copies to or from pinned host memory are non-blocking, and every copy is
queued on the current stream, so it runs after the work queued before it and before the work queued
after it (a block freed after a copy and handed to a later step is written only after the copy read
it). A caller that reads a non-blocking copy's host buffer on the host must first wait for the stream
itself, off the event loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.device_copy import host_tensor
from engine.kernels.huge_pages import huge_zeros
from engine.model.config import ModelConfig


@dataclass
class KVCache:
    """Per-layer paged K/V storage."""

    k: list[torch.Tensor]  # num_layers × [num_blocks, block_size, kv_heads, head_dim]
    v: list[torch.Tensor]  # num_layers × [num_blocks, block_size, kv_heads, head_dim]
    block_size: int

    @classmethod
    def allocate(
        cls,
        model: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> KVCache:
        shape = (num_blocks, block_size, model.num_kv_heads, model.head_dim)
        # One buffer for every layer's K and V (on huge pages: `engine.kernels.huge_pages`), viewed per layer.
        both = huge_zeros((2, model.num_layers, *shape), dtype, device)
        k, v = list(both[0].unbind(0)), list(both[1].unbind(0))
        return cls(k=k, v=v, block_size=block_size)

    @property
    def num_layers(self) -> int:
        return len(self.k)

    @property
    def num_blocks(self) -> int:
        return self.k[0].shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.k[0].dtype

    @property
    def device(self) -> torch.device:
        return self.k[0].device

    @property
    def block_shape(self) -> tuple[int, ...]:
        """Shape of one block of one layer: ``[block_size, kv_heads, head_dim]``."""
        return tuple(self.k[0].shape[1:])

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block over all layers, K and V."""
        return 2 * self.num_layers * self.k[0][0].numel() * self.k[0].element_size()

    def gather_blocks(self, block_ids: Sequence[int], out: torch.Tensor | None = None,
                      slots: Sequence[int] | None = None) -> torch.Tensor:
        """Copy the given blocks of every layer out of the cache.

        Without ``out``: a new ``[num_layers, 2, len(block_ids), block_size, kv_heads, head_dim]`` on
        the cache's device. With ``out`` ``[num_layers, 2, S, block_size, kv_heads, head_dim]`` on any
        device (the decode worker's host swap space): block ``block_ids[i]`` lands in
        ``out[:, :, slots[i]]`` (``slots`` by default ``0 .. n - 1``) and ``out`` is returned, nothing new
        allocated on any device; non-blocking where ``out`` is pinned host memory (read it on the host
        only after the device's stream has caught up).
        """
        if out is None:
            idx = host_tensor(list(block_ids), self.device)  # [n]
            new = torch.empty(
                (self.num_layers, 2, len(block_ids), *self.block_shape), dtype=self.dtype, device=self.device
            )
            for layer in range(self.num_layers):
                torch.index_select(self.k[layer], 0, idx, out=new[layer, 0])
                torch.index_select(self.v[layer], 0, idx, out=new[layer, 1])
            return new
        self._check_blocks(out, "out")
        runs = paired_runs(block_ids, range(len(block_ids)) if slots is None else slots)
        pinned = out.device.type == "cpu" and out.is_pinned()
        for layer in range(self.num_layers):
            for kv, src in ((0, self.k[layer]), (1, self.v[layer])):
                for b, s, n in runs:
                    out[layer, kv, s:s + n].copy_(src[b:b + n], non_blocking=pinned)  # [n, bs, H, D]
        return out

    def scatter_blocks(self, block_ids: Sequence[int], data: torch.Tensor, slots: Sequence[int] | None = None) -> None:
        """Inverse of `gather_blocks`: block ``block_ids[i]`` of every layer gets ``data[:, :, slots[i]]``
        (``slots`` by default ``0 .. n - 1``); ``data`` may live on another device (host swap space)."""
        if slots is None and data.device == self.device:
            idx = host_tensor(list(block_ids), self.device)  # [n]
            for layer in range(self.num_layers):
                self.k[layer].index_copy_(0, idx, data[layer, 0])
                self.v[layer].index_copy_(0, idx, data[layer, 1])
            return
        self._check_blocks(data, "data")
        runs = paired_runs(block_ids, range(len(block_ids)) if slots is None else slots)
        pinned = data.device.type == "cpu" and data.is_pinned()
        for layer in range(self.num_layers):
            for kv, dst in ((0, self.k[layer]), (1, self.v[layer])):
                for b, s, n in runs:
                    dst[b:b + n].copy_(data[layer, kv, s:s + n], non_blocking=pinned)  # [n, bs, H, D]

    def _check_blocks(self, t: torch.Tensor, name: str) -> None:
        """``t`` must be ``[num_layers, 2, S, *block_shape]`` of the cache's dtype, contiguous."""
        if tuple(t.shape[:2]) != (self.num_layers, 2) or tuple(t.shape[3:]) != self.block_shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}; blocks of this cache are "
                             f"[{self.num_layers}, 2, S, {', '.join(map(str, self.block_shape))}]")
        if t.dtype != self.dtype or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous {self.dtype} tensor, got {t.dtype}")


def paired_runs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(src start, dst start, length)`` of each run where both sides step by one:
    ``[5, 6, 9]`` → ``[0, 1, 2]`` gives ``[(5, 0, 2), (9, 2, 1)]``, so a copy moves a run in one call."""
    if len(src) != len(dst):
        raise ValueError(f"{len(src)} blocks but {len(dst)} slots")
    runs: list[tuple[int, int, int]] = []
    for b, s in zip(src, dst, strict=True):
        if runs and runs[-1][0] + runs[-1][2] == b and runs[-1][1] + runs[-1][2] == s:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((b, s, 1))
    return runs
