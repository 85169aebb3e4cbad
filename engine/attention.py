"""Attention over the paged KV cache, for prefill chunks and batched decode steps.

Owns: writing new K/V rows into cache slots and computing attention against a sequence's cached
rows. Works on any device; on CPU it uses torch's SDPA with GQA (no K/V head repetition copies).

Invariants: a *slot* is ``block_id * block_size + row``; a query at absolute position ``p`` sees
exactly the keys at positions ``0..p`` of its own sequence; padding rows of a batched decode step
are masked out, so batching never changes a sequence's result beyond float reassociation.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def write_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """k_cache/v_cache: [num_blocks, block_size, KV, D]; slots: [T]; k/v: [T, KV, D]."""
    nb, bs, kvh, d = k_cache.shape
    k_cache.view(nb * bs, kvh, d).index_copy_(0, slots, k)
    v_cache.view(nb * bs, kvh, d).index_copy_(0, slots, v)


def gather_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """slots: [...] → k, v: [..., KV, D] read from the flattened caches."""
    nb, bs, kvh, d = k_cache.shape
    return k_cache.view(nb * bs, kvh, d)[slots], v_cache.view(nb * bs, kvh, d)[slots]


def prefill_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    start_pos: int,
    context_slots: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """Causal attention of one sequence's chunk.

    q: [S, H, D]; k_new/v_new: [S, KV, D] (already written to the cache); ``start_pos`` tokens
    precede the chunk; ``context_slots``: [start_pos + S] slots of the whole context (only read
    when ``start_pos > 0``). Returns [S, H, D].
    """
    s = q.shape[0]
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, H, S, D]
    if start_pos == 0:
        k = k_new.transpose(0, 1).unsqueeze(0)  # [1, KV, S, D]
        v = v_new.transpose(0, 1).unsqueeze(0)
        out = F.scaled_dot_product_attention(qh, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        assert context_slots is not None
        kc, vc = gather_kv(k_cache, v_cache, context_slots)  # [L, KV, D]
        k = kc.transpose(0, 1).unsqueeze(0)  # [1, KV, L, D]
        v = vc.transpose(0, 1).unsqueeze(0)
        total = start_pos + s
        q_pos = torch.arange(start_pos, total, device=q.device).unsqueeze(1)  # [S, 1]
        k_pos = torch.arange(total, device=q.device).unsqueeze(0)  # [1, L]
        mask = k_pos <= q_pos  # [S, L]
        out = F.scaled_dot_product_attention(qh, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)  # [S, H, D]


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_table: torch.Tensor,
    valid: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One new query token per sequence.

    q: [B, H, D]; slot_table: [B, L] slots of each sequence's context (padded); valid: [B, L] bool.
    Returns [B, H, D].
    """
    k, v = gather_kv(k_cache, v_cache, slot_table)  # [B, L, KV, D]
    k = k.transpose(1, 2)  # [B, KV, L, D]
    v = v.transpose(1, 2)
    qh = q.unsqueeze(2)  # [B, H, 1, D]
    mask = valid[:, None, None, :]  # [B, 1, 1, L]
    out = F.scaled_dot_product_attention(qh, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.squeeze(2)  # [B, H, D]
