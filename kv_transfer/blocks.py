"""Which tensors travel in direct mode, and the block-run arithmetic behind it.

Owns: the wire order of direct transfers (the staging mode, every other transport, is in `streams.py`):

- direct (``direct = True``: ``local-direct``, in one process): the destination's block ids are cut
  into runs of consecutive ids; for each layer, for K then V, for each run, one tensor travels:
  ``[run_len, block_size, kv_heads, head_dim]``, a slice of the gathered tensor on the source and a
  view of the cache (``k[layer][start:start + run_len]``) on the destination, so bytes land
  straight in the blocks. PULL carries the run lengths so both sides cut identically. The number
  of tensors grows with the fragmentation of the destination's free list, and the source gathers
  the whole transfer at once: fine between two ends of one process, never used across processes
  (nccl and gloo stream, see `streams.py`).

Invariants: both sides produce lists of equal length and pairwise equal shape/dtype, in the order
above; every tensor is contiguous; nothing here does I/O.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.kv_cache import KVCache


def block_runs(block_ids: Sequence[int]) -> list[tuple[int, int]]:
    """``[5, 6, 7, 2, 3]`` → ``[(5, 3), (2, 2)]``: (first id, length) of each run of consecutive ids."""
    runs: list[tuple[int, int]] = []
    for b in block_ids:
        if runs and runs[-1][0] + runs[-1][1] == b:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((b, 1))
    return runs


def run_lengths(block_ids: Sequence[int]) -> tuple[int, ...]:
    return tuple(n for _, n in block_runs(block_ids))


def sync_device(t: torch.Tensor) -> None:
    """Wait until the kernels that produced ``t`` on this thread's stream are done (no-op on CPU)."""
    if t.device.type == "cuda":
        torch.cuda.current_stream(t.device).synchronize()


def source_tensors(cache: KVCache, block_ids: Sequence[int], runs: Sequence[int] | None) -> list[torch.Tensor]:
    """Copy the blocks out of the cache and cut them as the destination expects (see module doc)."""
    data = cache.gather_blocks(list(block_ids))  # [L, 2, n, bs, H, D]
    sync_device(data)
    if runs is None:
        return [data]
    if sum(runs) != len(block_ids):
        raise ValueError(f"runs sum to {sum(runs)}, not the {len(block_ids)} blocks")
    out = []
    for layer in range(cache.num_layers):
        for kv in (0, 1):
            off = 0
            for n in runs:
                out.append(data[layer, kv, off:off + n])  # [n, bs, H, D], contiguous
                off += n
    return out


def direct_views(cache: KVCache, block_ids: Sequence[int]) -> list[torch.Tensor]:
    """Views of the cache's blocks, in the direct-mode wire order (see module doc)."""
    runs = block_runs(block_ids)
    out = []
    for layer in range(cache.num_layers):
        for kv in (cache.k[layer], cache.v[layer]):
            for start, n in runs:
                out.append(kv[start:start + n])  # [n, bs, H, D], contiguous
    return out
