"""FlexAttention block masks over the paged KV cache, built from block tables and lengths.

Owns: `PagedMasks` (one step's masks: one `BlockMask` per window of the model's layers),
`decode_masks` and `prefill_masks` (their builders), `physical_to_logical` and `softcap_score_mod`.
Host-planned metadata reaches the device through `engine.device_copy.send` (no sync).

Layout: a layer's cache ``[NB, bs, KV, D]`` is read in place as flex's key and value
``[1, KV, NB * bs, D]`` (a strided view, broadcast over flex's batch), so kv index ``n`` is cache
slot ``n``: physical block ``n // bs``, row ``n % bs``. Decode queries are ``[B, H, 1, D]`` (flex's
batch ``b`` is decode row ``b``; its kv blocks are the row's block table); prefill queries are the
packed chunks ``[1, H, T, D]``, cut into tiles of ``Q_BLOCK`` tokens whose kv blocks are the union
of the blocks their tokens read. Either way the query token of ``(b, q_idx)`` is ``b + q_idx`` (one
of the two is always 0), which indexes the per-token tensors the mask reads.

Invariants: the mask_mod alone is exact: a key's logical position comes from the row's inverse
block table (`physical_to_logical`; -1 for a block outside the row's table or beyond its length,
so block-table padding and other sequences' blocks never leak), then the causal and window rules
of `engine.attention.ops.visible_keys`. The block lists are a superset of the blocks holding visible
keys, each block listed once per tile (chunks sharing prefix blocks are deduplicated), so the eager
path (which evaluates the mask everywhere and ignores the lists) and the compiled kernels (which
read only the listed blocks) agree. On CPU the lists are ``NB`` wide (the kernel wants the block
mask to span the whole key length), on CUDA as wide as a tile can need. Decode metadata reads only
device tensors and shapes, so a decode step's metadata can be rebuilt inside a captured CUDA graph.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.device_copy import send

if TYPE_CHECKING:  # imported where used: a torch without FlexAttention still imports this module
    from torch.nn.attention.flex_attention import BlockMask

#: Query tokens per tile of a prefill block mask (the GPU kernel runs with BLOCK_M = Q_BLOCK).
Q_BLOCK = 16
#: A decode row's one query tile: its height only has to be a multiple of the GPU decoding kernel's
#: BLOCK_M (the query heads sharing a KV head, at least 16).
DECODE_Q_BLOCK = 128

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class PagedMasks:
    """One step's block masks, keyed by layer window (None: full causal)."""

    masks: dict[int | None, BlockMask]


def physical_to_logical(block_table: torch.Tensor, num_blocks: torch.Tensor, total_blocks: int) -> torch.Tensor:
    """block_table [R, W] (padding beyond ``num_blocks`` [R] per row) → [R, NB + 1] int32: the logical
    index of each physical block in the row's table, -1 elsewhere (column NB collects the padding)."""
    rows, width = block_table.shape
    logical = torch.arange(width, device=block_table.device, dtype=torch.int32).expand(rows, width)  # [R, W]
    live = logical < num_blocks.unsqueeze(1)  # [R, W]
    p2l = torch.full((rows, total_blocks + 1), -1, dtype=torch.int32, device=block_table.device)
    return p2l.scatter_(1, torch.where(live, block_table.long(), total_blocks), logical.contiguous())


def paged_mask_mod(row: torch.Tensor, q_pos: torch.Tensor, p2l: torch.Tensor, block_size: int,
                   window: int | None) -> MaskMod:
    """The exact visibility rule: token ``b + q_idx`` of row ``row[.]`` at ``q_pos[.]`` sees slot ``kv_idx``."""

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        tok = b + q_idx
        logical = p2l[row[tok], kv_idx // block_size]
        k_pos = logical * block_size + kv_idx % block_size
        seen = (logical >= 0) & (k_pos <= q_pos[tok])
        return seen if window is None else seen & (k_pos > q_pos[tok] - window)

    return mask_mod


def softcap_score_mod(cap: float) -> Callable[..., torch.Tensor]:
    """Gemma 2's ``cap * tanh(score / cap)`` on the scaled score, before the mask."""

    def score_mod(score: torch.Tensor, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor,
                  kv_idx: torch.Tensor) -> torch.Tensor:
        return torch.tanh(score / cap) * cap

    return score_mod


def decode_masks(block_table: torch.Tensor, positions: torch.Tensor, block_size: int, total_blocks: int,
                 windows: Sequence[int | None]) -> PagedMasks:
    """Masks of one decode step: block_table [B, W] (padded), positions [B]; device tensors only."""
    from torch.nn.attention.flex_attention import BlockMask

    b, width = block_table.shape
    dev = block_table.device
    p2l = physical_to_logical(block_table, positions // block_size + 1, total_blocks)
    row = torch.arange(b, device=dev)
    last = positions // block_size  # [B] logical block of the new token
    masks = {}
    for window in windows:
        first = torch.zeros_like(last) if window is None else (positions - window + 1).clamp(min=0) // block_size
        cols = (torch.arange(width, device=dev) + first.unsqueeze(1)).clamp(max=width - 1)  # [B, W]
        kv = torch.gather(block_table, 1, cols).int()[:, :total_blocks]  # row's blocks from `first` on
        kv = torch.nn.functional.pad(kv, (0, _list_width(dev, total_blocks, kv.shape[1]) - kv.shape[1]))
        masks[window] = BlockMask.from_kv_blocks(
            (last - first + 1).int().view(b, 1, 1), kv.view(b, 1, 1, -1),
            BLOCK_SIZE=(DECODE_Q_BLOCK, block_size),
            mask_mod=paged_mask_mod(row, positions, p2l, block_size, window),
            seq_lengths=(1, total_blocks * block_size), compute_q_blocks=False,
        )
    return PagedMasks(masks)


def prefill_masks(block_tables: Sequence[torch.Tensor], positions: torch.Tensor, seq_lens: Sequence[int],
                  start_positions: Sequence[int], block_size: int, total_blocks: int,
                  windows: Sequence[int | None]) -> PagedMasks:
    """Masks of packed prefill chunks (chunk i: ``seq_lens[i]`` tokens from ``start_positions[i]``, block
    table ``block_tables[i]``), planned from the host-side lengths; positions [T] on the device."""
    from torch.nn.attention.flex_attention import BlockMask

    dev = positions.device
    ends = [s + n for s, n in zip(start_positions, seq_lens, strict=True)]
    nblocks = [-(-e // block_size) for e in ends]
    table = torch.nn.utils.rnn.pad_sequence(list(block_tables), batch_first=True)  # [S, M]
    p2l = physical_to_logical(table, send(torch.tensor(nblocks), dev), total_blocks)
    row = send(torch.repeat_interleave(torch.arange(len(seq_lens)), torch.tensor(list(seq_lens))), dev)  # [T]
    masks = {}
    for window in windows:
        kv_num, kv = _tile_blocks(table, _segments(seq_lens, start_positions, block_size, window), total_blocks)
        masks[window] = BlockMask.from_kv_blocks(
            kv_num.view(1, 1, -1), kv.view(1, 1, *kv.shape), BLOCK_SIZE=(Q_BLOCK, block_size),
            mask_mod=paged_mask_mod(row, positions, p2l, block_size, window),
            seq_lengths=(sum(seq_lens), total_blocks * block_size), compute_q_blocks=False,
        )
    return PagedMasks(masks)


def _segments(seq_lens: Sequence[int], start_positions: Sequence[int], block_size: int,
              window: int | None) -> list[list[tuple[int, int, int]]]:
    """Per query tile: (chunk, first, last logical block) of each chunk's tokens in it (host ints)."""
    tiles: list[list[tuple[int, int, int]]] = [[] for _ in range(-(-sum(seq_lens) // Q_BLOCK))]
    offset = 0
    for chunk, (n, start) in enumerate(zip(seq_lens, start_positions, strict=True)):
        for tile in range(offset // Q_BLOCK, -(-(offset + n) // Q_BLOCK)):
            lo_tok, hi_tok = max(offset, tile * Q_BLOCK) - offset, min(offset + n, (tile + 1) * Q_BLOCK) - offset - 1
            lo_pos = 0 if window is None else max(0, start + lo_tok - window + 1)
            tiles[tile].append((chunk, lo_pos // block_size, (start + hi_tok) // block_size))
        offset += n
    return tiles


def _tile_blocks(table: torch.Tensor, tiles: list[list[tuple[int, int, int]]],
                 total_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(kv_num [NQ] int32, kv_indices [NQ, N] int32): each tile's distinct physical blocks (N: `_list_width`)."""
    dev, width = table.device, table.shape[1]
    k = max(len(t) for t in tiles)
    pad = [(0, 1, 0)] * k  # an empty range (first > last)
    seg = send(torch.tensor([t + pad[len(t):] for t in tiles]), dev)  # [NQ, K, 3]
    cols = torch.arange(width, device=dev)
    inside = (cols >= seg[..., 1:2]) & (cols <= seg[..., 2:3])  # [NQ, K, W]
    cand = torch.where(inside, table[seg[..., 0]].int(), total_blocks).flatten(1)  # [NQ, K * W], NB: none
    cand, _ = cand.sort(dim=1)
    keep = cand < total_blocks
    keep[:, 1:] &= cand[:, 1:] != cand[:, :-1]  # first of each run of equal ids
    out = _list_width(dev, total_blocks, min(total_blocks, cand.shape[1]))
    dest = torch.where(keep, keep.cumsum(1) - 1, out)  # a tile's distinct ids number at most `out`
    kv = torch.zeros(len(tiles), out + 1, dtype=torch.int32, device=dev).scatter_(1, dest, cand)
    return keep.sum(1).int(), kv[:, :out]


def _list_width(device: torch.device, total_blocks: int, needed: int) -> int:
    """Columns of a kv block list: the CPU kernel wants them to span the whole cache, CUDA's do not."""
    return total_blocks if device.type == "cpu" else needed
