"""The paged KV cache tensors of one process.

Owns: per-layer K and V tensors of shape ``[num_blocks, block_size, kv_heads, head_dim]`` and the
copy helpers that move whole blocks in and out of them (used by the transports and by swap).

Invariants: block ``b`` of layer ``l`` is ``k[l][b]`` / ``v[l][b]``; a token at position ``p`` of a
sequence with block table ``bt`` lives at ``bt[p // block_size]``, row ``p % block_size``. The cache
knows nothing of which blocks are in use: that is `engine.block_pool.BlockPool`'s job. Every
layer's K and V are contiguous views of one zeroed buffer, on huge pages where the OS gives them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import ModelConfig
from engine.kernels.huge_pages import huge_zeros


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

    def gather_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """Copy the given blocks of every layer into one contiguous tensor.

        Returns ``[num_layers, 2, len(block_ids), block_size, kv_heads, head_dim]``.
        """
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        out = torch.empty(
            (self.num_layers, 2, len(block_ids), *self.block_shape), dtype=self.dtype, device=self.device
        )
        for layer in range(self.num_layers):
            torch.index_select(self.k[layer], 0, idx, out=out[layer, 0])
            torch.index_select(self.v[layer], 0, idx, out=out[layer, 1])
        return out

    def scatter_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Inverse of `gather_blocks`: write ``data`` into the given blocks of every layer."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        for layer in range(self.num_layers):
            self.k[layer].index_copy_(0, idx, data[layer, 0])
            self.v[layer].index_copy_(0, idx, data[layer, 1])
