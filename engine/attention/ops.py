"""Attention functions over the paged KV cache that the backends share.

Owns: writing new K/V rows into cache slots (`write_kv`), the visibility rule (`visible_keys`:
causal, optionally windowed), a prefill chunk's attention (`prefill_attention`: SDPA ``is_causal``
from position 0, else over its context read slot by slot or block by block; the C++ kernel where
the CPU backend asks for it; explicit scores in query blocks where scores are soft-capped) and the
reference decode attention (`decode_attention`: every context slot gathered, SDPA with a bool mask).
The CPU backend's faster decode methods are `engine.kernels.gathered_decode`'s.

Invariants: a *slot* is ``block_id * block_size + row``; a query at absolute position ``p`` sees
exactly the keys at positions ``0..p`` of its own sequence (the last ``window`` of them in a
windowed layer); padding is masked out, so batching never changes a sequence's result beyond float
reassociation. Soft-capping (``cap * tanh(scores / cap)``, Gemma 2) happens before the mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels.native_prefill import native_prefill_applies, native_prefill_attention


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


def visible_keys(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Which keys each query sees (broadcast of ``q_pos`` against ``k_pos``): the causal rule, and
    with a ``window`` only the last ``window`` positions, the query's own included (transformers')."""
    seen = k_pos <= q_pos
    return seen if window is None else seen & (k_pos > q_pos - window)


def prefill_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    start_pos: int,
    context_slots: torch.Tensor | None,
    scale: float,
    context_blocks: torch.Tensor | None = None,
    native: bool = False,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of one sequence's chunk.

    q: [S, H, D]; k_new/v_new: [S, KV, D] (already written to the cache); ``start_pos`` tokens
    precede the chunk; the context (only read when ``start_pos > 0``) is given either as
    ``context_slots``: [start_pos + S] slots, or as ``context_blocks``: [ceil((start_pos + S) / bs)]
    block ids (cheaper: whole blocks are copied). ``native``: fp32 chunks the C++ kernel takes run
    there (`engine.kernels.native_prefill`), the rest through SDPA. ``window``: each query sees only the last
    ``window`` positions, its own included (a sliding-window layer; the C++ kernel does not take it).
    ``softcap``: scores soft-capped (`explicit_prefill_attention`; neither SDPA nor the C++ kernel).
    Returns [S, H, D].
    """
    s = q.shape[0]
    windowed = window is not None and start_pos + s > window  # else the window hides nothing
    native = native and not windowed and softcap is None
    if native and start_pos == 0 and native_prefill_applies(q, k_new, v_new):
        return native_prefill_attention(q, k_new, v_new, 0, scale)
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, H, S, D]
    if start_pos == 0 and not windowed and softcap is None:
        k = k_new.transpose(0, 1).unsqueeze(0)  # [1, KV, S, D]
        v = v_new.transpose(0, 1).unsqueeze(0)
        out = F.scaled_dot_product_attention(qh, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        total = start_pos + s
        if start_pos == 0:
            kc, vc = k_new, v_new
        elif context_blocks is not None:  # copy whole blocks (contiguous rows), keep the first L rows
            kc = k_cache.index_select(0, context_blocks).flatten(0, 1)[:total]  # [L, KV, D]
            vc = v_cache.index_select(0, context_blocks).flatten(0, 1)[:total]
        else:
            assert context_slots is not None
            kc, vc = gather_kv(k_cache, v_cache, context_slots)  # [L, KV, D]
        if native and native_prefill_applies(q, kc, vc):
            return native_prefill_attention(q, kc, vc, start_pos, scale)
        if softcap is not None:
            return explicit_prefill_attention(q, kc, vc, start_pos, scale, softcap, window)
        k = kc.transpose(0, 1).unsqueeze(0)  # [1, KV, L, D]
        v = vc.transpose(0, 1).unsqueeze(0)
        q_pos = torch.arange(start_pos, total, device=q.device).unsqueeze(1)  # [S, 1]
        k_pos = torch.arange(total, device=q.device).unsqueeze(0)  # [1, L]
        mask = visible_keys(q_pos, k_pos, window if windowed else None)  # [S, L]
        out = F.scaled_dot_product_attention(qh, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)  # [S, H, D]


#: Query rows x keys x heads of one block's scores in `explicit_prefill_attention` (64 MiB of fp32).
SCORE_BLOCK_ELEMENTS = 2**24


def soft_cap(scores: torch.Tensor, cap: float) -> torch.Tensor:
    """``cap * tanh(scores / cap)``, transformers' order of operations (in place on ``scores``)."""
    return scores.div_(cap).tanh_().mul_(cap)


def explicit_prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start_pos: int, scale: float, softcap: float | None,
    window: int | None,
) -> torch.Tensor:
    """Causal attention with the scores formed explicitly (so they can be soft-capped), a block of
    queries at a time over only the keys the block can see.

    q: [S, H, D] at positions ``start_pos ..``; k/v: [start_pos + S, KV, D]. Returns [S, H, D].
    """
    s_len, h, d = q.shape
    kvh = k.shape[1]
    g = h // kvh
    out = torch.empty_like(q)
    rows = max(1, SCORE_BLOCK_ELEMENTS // (h * k.shape[0]))
    for lo in range(0, s_len, rows):
        hi = min(s_len, lo + rows)
        first = 0 if window is None else max(0, start_pos + lo - window + 1)  # the first key any row sees
        kb, vb = k[first : start_pos + hi], v[first : start_pos + hi]  # [L, KV, D]
        qb = q[lo:hi].view(hi - lo, kvh, g, d).permute(1, 2, 0, 3).reshape(kvh, g * (hi - lo), d)  # [KV, G*R, D]
        scores = torch.bmm(qb, kb.permute(1, 2, 0)).mul_(scale)  # [KV, G*R, L]
        if softcap is not None:
            soft_cap(scores, softcap)
        q_pos = torch.arange(start_pos + lo, start_pos + hi, device=q.device).unsqueeze(1)  # [R, 1]
        k_pos = torch.arange(first, start_pos + hi, device=q.device).unsqueeze(0)  # [1, L]
        hidden = ~visible_keys(q_pos, k_pos, window)  # [R, L]
        scores = scores.view(kvh, g, hi - lo, -1).masked_fill_(hidden, float("-inf"))
        p = torch.softmax(scores.float(), dim=-1).to(v.dtype).view(kvh, g * (hi - lo), -1)
        o = torch.bmm(p, vb.transpose(0, 1))  # [KV, G*R, D]
        out[lo:hi] = o.view(kvh, g, hi - lo, d).permute(2, 0, 1, 3).reshape(hi - lo, h, d)
    return out


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_table: torch.Tensor,
    valid: torch.Tensor,
    scale: float,
    softcap: float | None = None,
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
    if softcap is not None:  # transformers' eager order: scale, cap, mask, fp32 softmax
        b, h, d = q.shape
        kvh = k.shape[1]
        scores = torch.matmul(q.view(b, kvh, h // kvh, d), k.transpose(2, 3)).mul_(scale)  # [B, KV, G, L]
        scores = soft_cap(scores, softcap).masked_fill_(~mask, float("-inf"))
        p = torch.softmax(scores.float(), dim=-1).to(v.dtype)
        return torch.matmul(p, v).view(b, h, d)  # [B, H, D]
    out = F.scaled_dot_product_attention(qh, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.squeeze(2)  # [B, H, D]
