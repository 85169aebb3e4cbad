"""Paged decode attention that reads K/V in place through the block table, compiled by inductor.

Owns: `paged_attention_in_place` (one query token per sequence against its cached positions, written
as indexing, multiply, reduce and softmax so that `torch.compile` fuses the block-table gather into
the score and output reductions: no ``[B, L, KV, D]`` copy of the context is ever made) and its
compiled twin `compiled_paged_attention`, which `attention.paged_decode_attention` runs for the
``"compiled"`` method.

Why: the eager paths copy every sequence's blocks into a buffer each layer (``index_select``, about
memcpy speed) and then read them again in a matmul; the fused kernel reads each block once where it
is used, so a layer at large batches and long contexts costs less than the gather and the product
together (figures: docs/benchmarks-notes.md).

Invariants: scores, softmax and the weighted sum run in fp32 whatever the cache dtype; the result
is the same attention as `attention.decode_attention` up to float reassociation (tested); padding
positions carry ``-inf`` in ``bias`` and never contribute; compiling needs a C++ compiler at
runtime (inductor's), so `engine.kernels.attention_choice` only picks this method after a call succeeded.
One graph serves every batch size from 2 and every context length (both marked dynamic; a step of 1
block is padded to 2, never specialized; batch 1 stays eager), compiled on first use (seconds, fewer from
inductor's disk cache), so a serving process compiles at load, in `engine.kernels.attention_choice`, never
mid-stream.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def paged_attention_in_place(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    bias: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q [B, H, D]; caches [num_blocks, bs, KV, D]; block_table [B, nb]; bias [B, 1, nb * bs] → [B, H * D].

    Eager, this materializes the gathered context (correct, slow); compiled, the gather is fused away.
    """
    b, nb = block_table.shape
    _, bs, kvh, d = k_cache.shape
    g = q.shape[1] // kvh
    length = nb * bs
    k = k_cache[block_table].view(b, length, kvh, 1, d).float()  # [B, L, KV, 1, D]
    v = v_cache[block_table].view(b, length, kvh, 1, d).float()
    qv = q.float().view(b, 1, kvh, g, d)  # [B, 1, KV, G, D]: head h = kv * G + g
    s = (k * qv).sum(-1) * scale + bias.view(b, length, 1, 1)  # [B, L, KV, G]
    p = torch.softmax(s, dim=1)  # over positions
    o = (p.unsqueeze(-1) * v).sum(1)  # [B, KV, G, D]
    return o.reshape(b, kvh * g * d).to(q.dtype)


_compiled = torch.compile(paged_attention_in_place)


def compiled_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    bias: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """`paged_attention_in_place`, compiled once per head geometry, dtype and scale for every step size.

    Batch, block count and cache size are marked dynamic, so one graph serves every step (and
    `engine.Engine` compiles it at load against its own cache, never mid-stream). Sizes of 1 would be
    specialized: a single block is padded with a masked duplicate, and a batch of 1 is the caller's
    to avoid (`engine.kernels.gathered_decode.paged_decode_attention` runs batch 1 eagerly). Guards also key on strides
    and inference-mode-ness: ``q`` is made contiguous, and the runner builds its step tensors in
    inference mode, as the model builds ``q``.
    """
    if block_table.shape[1] == 1:
        block_table = torch.cat([block_table, block_table], 1)  # [B, 2]
        bias = F.pad(bias, (0, k_cache.shape[1]), value=float("-inf"))  # the copy is never visible
    q = q.contiguous()  # the model's q is a strided view of its qkv output
    for t, dims in ((q, (0,)), (k_cache, (0,)), (v_cache, (0,)), (block_table, (0, 1)), (bias, (0, 2))):
        for dim in dims:
            torch._dynamo.mark_dynamic(t, dim)
    return _compiled(q, k_cache, v_cache, block_table, bias, scale)
