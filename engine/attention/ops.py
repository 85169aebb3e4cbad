"""Attention over the paged KV cache, for prefill chunks and batched decode steps.

Owns: writing new K/V rows into cache slots and computing attention against a sequence's cached rows. Two decode
paths: the reference (`decode_attention`: gather every context slot, SDPA with a bool mask) and the fast one
(`paged_decode_attention`: the method of `DECODE_METHODS` this machine runs fastest, either whole-block copies then
batched matmuls, softmax in fp32, or the compiled kernel that reads the blocks in place). Prefill uses SDPA
(``is_causal`` when a chunk starts at position 0). Attention logit soft-capping (``softcap``: scores become ``cap *
tanh(scores / cap)`` before the mask, Gemma 2) has no SDPA: prefill then runs `explicit_prefill_attention` (explicit
scores a block of queries at a time), decode the methods that form the scores themselves (`SOFTCAP_METHODS`).

Invariants: a *slot* is ``block_id * block_size + row``; a query at absolute position ``p`` sees exactly the keys at
positions ``0..p`` of its own sequence; padding rows of a batched decode step are masked out (an additive ``-inf``
bias, or ``False`` in a bool mask), so batching never changes a sequence's result beyond float reassociation. Scratch
buffers (`Workspace`) are reused across layers and steps but never carry information from one call to the next.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

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


class Workspace:
    """Per-thread scratch tensors, grown on demand and reused by every layer and step.

    ``buffer`` contents are undefined on return; ``zeros`` buffers are zero when first made and the
    caller must only ever write the positions it rewrites on every use (here: a diagonal).
    """

    def __init__(self) -> None:
        self._local = threading.local()

    def _get(
        self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, zero: bool
    ) -> torch.Tensor:
        store: dict[tuple[str, torch.dtype], torch.Tensor] = self._local.__dict__.setdefault("store", {})
        n = 1
        for d in shape:
            n *= d
        flat = store.get((name, dtype))
        if flat is None or flat.numel() < n or flat.device != device:
            flat = (torch.zeros if zero else torch.empty)(max(n, 1), dtype=dtype, device=device)
            store[(name, dtype)] = flat
        return flat[:n].view(shape)

    def buffer(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self._get(name, shape, dtype, device, zero=False)

    def zeros(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self._get(name, shape, dtype, device, zero=True)


#: bf16 decode steps with at most this many (sequence, position) rows are cast to fp32 and take its paths.
SMALL_DECODE_ROWS = 512
#: The formulations of batched (B > 1) fp32 decode attention over the gathered blocks, plus
#: ``"compiled"`` (`engine.kernels.compiled_attention`: no gather, from 2 sequences up, any dtype) and
#: ``"native"`` (`engine.kernels.native_attention`: a C++ kernel, no gather, fp32 and bf16); which is
#: fastest differs between CPUs, even in its order (`engine.kernels.attention_choice` times them at load).
GATHERED_METHODS = ("sdpa", "per_head", "block_diagonal")
DECODE_METHODS = (*GATHERED_METHODS, "compiled", "native")
#: The methods that form the scores themselves, so they can soft-cap them (``softcap``).
SOFTCAP_METHODS = ("per_head", "block_diagonal")


@dataclass
class PagedDecodeMeta:
    """What every layer of one decode step shares (built once per step by `engine.runner`)."""

    block_ids: torch.Tensor  # [B * n_blocks] each sequence's block table, padded with any valid block id
    bias: torch.Tensor  # [B, 1, L] fp32: 0 at positions <= the sequence's position, -inf after; L = n_blocks * bs
    batch: int  # B
    n_blocks: int
    lengths: torch.Tensor | None = None  # [B] int64 visible positions (position + 1); derived from bias if None

    def visible(self) -> torch.Tensor:
        """[B] int64 positions each sequence sees (``1..n_blocks * bs``), computed once per step."""
        if self.lengths is None:
            self.lengths = (self.bias[:, 0] == 0).sum(-1)
        return self.lengths


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: PagedDecodeMeta,
    ws: Workspace,
    scale: float,
    method: str = "per_head",
    softcap: float | None = None,
) -> torch.Tensor:
    """One new query token per sequence, read from the paged cache block by block.

    q: [B, H, D]; k_cache/v_cache: [num_blocks, bs, KV, D]. Returns [B, H * D].

    The blocks are copied whole (contiguous rows, ~memcpy speed) into one reused buffer in the
    cache's own layout ``[B, L, KV, D]``. GQA is folded into the matmul: each sequence's query
    becomes a block-diagonal ``[H, KV * D]`` matrix (head ``h`` sees only KV head ``h // G``), so
    ``Qblk @ K[B, L, KV * D]^T`` gives every head's scores against its own KV head with contiguous
    operands and no per-head loop, and ``P @ V[B, L, KV * D]`` gives ``[B, H, KV * D]`` of which
    each head keeps its own KV head's slice. That is KV times the minimal FLOPs, cheap next to
    reading K and V: on CPU it beats SDPA (slow for one query, in bf16 most) and, in bf16, per-head
    loops over strided views. In fp32
    the fastest of `GATHERED_METHODS` depends on the CPU: ``method`` picks one (`batched_decode_attention`);
    batch 1 needs no choice (`_single_decode_attention`); small bf16 steps
    (``B * L <= SMALL_DECODE_ROWS``) take the fp32 paths after a cast. ``method="compiled"`` skips all
    of this from 2 sequences up: `engine.kernels.compiled_attention` reads the blocks in place, in any dtype
    (at batch 1 its fixed cost is more than the one-sequence gather it saves);
    ``method="native"`` does the same at every batch size with `engine.kernels.native_attention`'s C++
    kernel, faster than both where it builds. ``softcap`` (a method of `SOFTCAP_METHODS` only): scores
    soft-capped before the mask.
    """
    _check_softcap(method, softcap)
    b, _, d = q.shape
    _, bs, kvh, _ = k_cache.shape
    length = meta.n_blocks * bs
    dev, dt = q.device, k_cache.dtype
    if method == "native":  # any batch: no fixed cost worth a gather (batch 1 runs on one thread)
        from engine.kernels.native_attention import native_paged_attention

        return native_paged_attention(q, k_cache, v_cache, meta.block_ids.view(b, meta.n_blocks), meta.visible(),
                                      scale)
    if method == "compiled" and b > 1:  # batch 1: the gather is small and the compiled call's fixed cost is not
        from engine.kernels.compiled_attention import compiled_paged_attention  # imports inductor: only when used

        return compiled_paged_attention(q, k_cache, v_cache, meta.block_ids.view(b, meta.n_blocks), meta.bias,
                                        scale)
    kb = ws.buffer("k", (b * meta.n_blocks, bs, kvh, d), dt, dev)
    vb = ws.buffer("v", (b * meta.n_blocks, bs, kvh, d), dt, dev)
    torch.index_select(k_cache, 0, meta.block_ids, out=kb)
    torch.index_select(v_cache, 0, meta.block_ids, out=vb)
    if b == 1:
        return _single_decode_attention(q, kb, vb, meta.bias, scale, softcap)
    if dt == torch.float32 or b * length <= SMALL_DECODE_ROWS:
        # Small bf16 steps are faster converted to fp32 than through bf16 bmm's fixed costs.
        if dt != torch.float32:
            kb = ws.buffer("k32", tuple(kb.shape), torch.float32, dev).copy_(kb)
            vb = ws.buffer("v32", tuple(vb.shape), torch.float32, dev).copy_(vb)
        return batched_decode_attention(q, kb.view(b, length, kvh, d), vb.view(b, length, kvh, d), meta.bias,
                                        scale, method, ws, softcap)
    return _block_diagonal_decode_attention(q, kb.view(b, length, kvh, d), vb.view(b, length, kvh, d), meta.bias,
                                            scale, ws, softcap)


def batched_decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float, method: str,
    ws: Workspace, softcap: float | None = None,
) -> torch.Tensor:
    """Gathered fp32 K/V ``[B, L, KV, D]``, q [B, H, D], bias [B, 1, L] → [B, H * D] in q's dtype.

    ``method`` is one of `GATHERED_METHODS`; all compute the same attention up to float reassociation.
    """
    if method == "per_head":
        return _per_head_decode_attention(q, k, v, bias, scale, softcap)
    if method == "block_diagonal":
        return _block_diagonal_decode_attention(q.to(k.dtype), k, v, bias, scale, ws, softcap).to(q.dtype)
    _check_softcap(method, softcap)
    if method == "sdpa":
        b, h, d = q.shape
        out = F.scaled_dot_product_attention(  # q [B, H, 1, D] against k/v [B, KV, L, D] (strided views)
            q.to(k.dtype).unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=bias.unsqueeze(1),
            scale=scale, enable_gqa=True,
        )
        return out.reshape(b, h * d).to(q.dtype)
    raise ValueError(f"unknown decode attention method {method!r}; expected one of {GATHERED_METHODS}")


def _block_diagonal_decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float, ws: Workspace,
    softcap: float | None = None,
) -> torch.Tensor:
    """K/V ``[B, L, KV, D]`` (contiguous) and q [B, H, D] in one dtype, bias [B, 1, L] → [B, H * D]."""
    b, h, d = q.shape
    length, kvh = k.shape[1], k.shape[2]
    g, dt = h // kvh, k.dtype
    qblk = ws.zeros("qblk", (b, kvh, g, kvh, d), dt, q.device)  # only the kv == kv' diagonal is ever written
    qblk.diagonal(dim1=1, dim2=3).copy_(q.view(b, kvh, g, d).permute(0, 2, 3, 1))  # [B, G, D, KV]
    s = torch.bmm(qblk.view(b, h, kvh * d), k.reshape(b, length, kvh * d).transpose(1, 2))  # [B, H, L]
    if softcap is not None:
        s = soft_cap(s.float().mul_(scale), softcap)
        scale = 1.0
    s = torch.add(bias, s, alpha=scale)  # [B, H, L] fp32, padding at -inf
    p = torch.softmax(s, dim=-1)
    if p.dtype != dt:
        p = p.to(dt)
    o = torch.bmm(p, v.reshape(b, length, kvh * d))  # [B, H, KV * D]
    o = o.view(b, kvh, g, kvh, d).diagonal(dim1=1, dim2=3)  # [B, G, D, KV]: each head's own KV head
    return o.permute(0, 3, 1, 2).reshape(b, h * d)  # [B, H * D], h = kv * G + g


def _single_decode_attention(
    q: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor, bias: torch.Tensor, scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """One sequence: q [1, H, D], its gathered blocks kb/vb [n_blocks, bs, KV, D], bias [1, 1, L].

    GQA without padding FLOPs: the KV heads are the bmm batch, each with its G query heads as rows,
    and K is read in place as the strided ``[KV, D, L]`` view (a transposed matrix to BLAS). In
    fp32 (bf16 is computed in fp32 here, like the other small steps); faster than SDPA for one
    query, which pays for a mask and general strides.
    """
    _, h, d = q.shape
    kvh = kb.shape[2]
    length = kb.shape[0] * kb.shape[1]
    k = kb.view(length, kvh, d).permute(1, 2, 0).float()  # [KV, D, L]
    v = vb.view(length, kvh, d).transpose(0, 1).float()  # [KV, L, D]
    s = _scores(bias.expand(kvh, h // kvh, length), q.float().view(kvh, h // kvh, d), k, scale, softcap)
    p = torch.softmax(s, dim=-1)  # [KV, G, L] fp32; padding positions at -inf get 0
    return torch.bmm(p, v).view(1, h * d).to(q.dtype)  # [1, H * D], h = kv * G + g


def _per_head_decode_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor, scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """fp32 K/V ``[B, L, KV, D]``, q [B, H, D], bias [B, 1, L] → [B, H * D] in q's dtype.

    One baddbmm + softmax + bmm per KV head: ``k[:, :, kv]`` is a ``[B, L, D]`` view with row
    stride ``KV * D``, which batched BLAS reads in place, and the head's G query heads are the rows.
    """
    b, h, d = q.shape
    kvh, length = k.shape[2], k.shape[1]
    g = h // kvh
    qv = q.float().view(b, kvh, g, d)
    mask = bias.expand(b, g, length)
    outs = []
    for i in range(kvh):
        s = _scores(mask, qv[:, i], k[:, :, i].transpose(1, 2), scale, softcap)  # [B, G, L]
        outs.append(torch.bmm(torch.softmax(s, dim=-1), v[:, :, i]))  # [B, G, D]
    return torch.stack(outs, 1).view(b, h * d).to(q.dtype)  # h = kv * G + g


def _check_softcap(method: str, softcap: float | None) -> None:
    if softcap is not None and method not in SOFTCAP_METHODS:
        raise ValueError(f"decode attention {method!r} cannot soft-cap scores; use one of {SOFTCAP_METHODS}")


def _scores(bias: torch.Tensor, q: torch.Tensor, kt: torch.Tensor, scale: float, softcap: float | None) -> torch.Tensor:
    """``bias + scale * q @ kt`` (batched; one baddbmm), soft-capped before the bias where ``softcap``."""
    if softcap is None:
        return torch.baddbmm(bias, q, kt, alpha=scale)
    return soft_cap(torch.bmm(q, kt).mul_(scale), softcap).add_(bias)
