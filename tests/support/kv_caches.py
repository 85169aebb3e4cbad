"""KV caches for the transfer tests: SmolLM2-shaped layouts, seeded caches, digests of blocks.

Owns: the tests' cluster `SECRET`, the `SMOL` layout, `make_cache` (random or zero contents) and
`digest` (what travelled is checked by hashing the gathered blocks on both sides).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from engine.kv_cache import KVCache
from kv_transfer.layout import KVLayout

SECRET = b"pdserve-test-cluster-secret-0123"
#: SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64; fp32, 16-token blocks (737,280 B per block).
SMOL = KVLayout(arch="llama", num_layers=30, num_kv_heads=3, head_dim=64, dtype="float32", block_size=16)


def make_cache(layout: KVLayout, num_blocks: int, seed: int | None = None) -> KVCache:
    """A cache of ``layout``; random contents when ``seed`` is given, zeros otherwise."""
    shape = (num_blocks, *layout.block_shape)
    g = torch.Generator().manual_seed(seed) if seed is not None else None

    def one() -> torch.Tensor:
        if g is None:
            return torch.zeros(shape, dtype=layout.torch_dtype)
        return torch.rand(shape, generator=g).to(layout.torch_dtype)

    return KVCache(k=[one() for _ in range(layout.num_layers)], v=[one() for _ in range(layout.num_layers)],
                   block_size=layout.block_size)


def digest(cache: KVCache, block_ids: Sequence[int]) -> str:
    """sha256 of the gathered blocks' raw bytes (order matters, dtype-agnostic)."""
    data = cache.gather_blocks(list(block_ids)).contiguous()
    return hashlib.sha256(data.view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
