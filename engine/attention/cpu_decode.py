"""The CPU backend's decode-step metadata and its grouped paged attention.

Owns: `decode_groups` (a step's rows, sorted by context length, split into consecutive groups
each padded only to its own longest context, so one long sequence does not make every short one
attend over its length; an additive mask per group, and per window size a windowed copy) and
`grouped_attention` (each group through `engine.kernels.gathered_decode.paged_decode_attention` by the
method `engine.kernels.attention_choice` picked for its size).

Invariants: padding positions carry ``-inf`` in the bias (and lie beyond each row's length), so a
row's result does not depend on its group; groups cover the batch's rows in order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.attention.base import AttentionSpec, LayerAttention
from engine.attention.ops import visible_keys
from engine.batch import DecodeBatch
from engine.kernels.attention_choice import AttentionChoice
from engine.kernels.gathered_decode import PagedDecodeMeta, Workspace, paged_decode_attention
from engine.kv_cache import KVCache


@dataclass
class DecodeGroups:
    full: list[PagedDecodeMeta]  # the groups for layers that see every earlier position
    windowed: dict[int, list[PagedDecodeMeta]]  # window → the same groups with the window in their biases


def group_by_length(needs: Sequence[int], max_groups: int = 4, slack: float = 2.0) -> list[tuple[int, int]]:
    """Split ascending block counts into consecutive ranges ``[lo, hi)``.

    A new range starts where a row needs more than ``slack`` × the blocks of its range's first row
    (the padding it would cost the short rows beats the cost of one more attention call), at most
    ``max_groups`` ranges.
    """
    ranges: list[tuple[int, int]] = []
    lo = 0
    for i in range(1, len(needs)):
        if needs[i] > slack * needs[lo] and len(ranges) < max_groups - 1:
            ranges.append((lo, i))
            lo = i
    ranges.append((lo, len(needs)))
    return ranges


def windowed_meta(meta: PagedDecodeMeta, window: int) -> PagedDecodeMeta:
    """``meta`` for a layer that sees only the last ``window`` positions (its own included): the
    earlier ones masked in the bias too; its lengths stay the full ones (only the bias carries the
    window, so the caller must not pick a method that reads lengths alone)."""
    pos = meta.visible() - 1  # [B]
    cols = torch.arange(meta.bias.shape[-1], device=meta.bias.device)  # [L]
    hidden = ~visible_keys(pos.unsqueeze(1), cols.unsqueeze(0), window).unsqueeze(1)  # [B, 1, L] (later ones too)
    return PagedDecodeMeta(block_ids=meta.block_ids, bias=meta.bias.masked_fill(hidden, float("-inf")),
                           batch=meta.batch, n_blocks=meta.n_blocks, lengths=pos + 1)


def decode_groups(batch: DecodeBatch, block_size: int, spec: AttentionSpec) -> DecodeGroups:
    """The groups of a step whose rows are sorted by ascending context length."""
    bs, table, positions = block_size, batch.block_table, batch.positions
    n_blocks = table.shape[1]
    cols = torch.arange(n_blocks * bs, device=positions.device)  # [L]
    bias = torch.zeros((batch.batch, 1, n_blocks * bs), dtype=torch.float32, device=positions.device)
    bias.masked_fill_((cols.unsqueeze(0) > positions.unsqueeze(1)).unsqueeze(1), float("-inf"))  # [B, 1, L]
    full = []
    for lo, hi in group_by_length(batch.row_blocks):
        nb = batch.row_blocks[hi - 1]
        full.append(PagedDecodeMeta(block_ids=table[lo:hi, :nb].reshape(-1),
                                    bias=bias[lo:hi, :, : nb * bs].contiguous(), batch=hi - lo, n_blocks=nb,
                                    lengths=positions[lo:hi] + 1))
    windows = {la.window for la in spec.layers if la.window is not None}
    return DecodeGroups(full, {w: [windowed_meta(m, w) for m in full] for w in windows})


def _method(choice: AttentionChoice, meta: PagedDecodeMeta, block_size: int, bias_only: bool) -> str:
    method = choice.method_for(meta.batch * meta.n_blocks * block_size)
    return "per_head" if bias_only and method == "native" else method  # the C++ kernel takes lengths only


def grouped_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, groups: DecodeGroups,
                      layer: LayerAttention, choice: AttentionChoice, ws: Workspace) -> torch.Tensor:
    """q: [B, H, D] with the groups' rows consecutive → [B, H * D]."""
    windowed = layer.window is not None
    metas = groups.windowed[layer.window] if layer.window is not None else groups.full
    outs, start = [], 0
    for meta in metas:
        outs.append(paged_decode_attention(q[start : start + meta.batch], k_cache, v_cache, meta, ws, layer.scale,
                                           _method(choice, meta, k_cache.shape[1], windowed), layer.softcap))
        start += meta.batch
    return torch.cat(outs) if len(outs) > 1 else outs[0]


@torch.inference_mode()  # as a step's tensors are: a compiled kernel's guards read it
def warm_up_compiled(choice: AttentionChoice, spec: AttentionSpec, cache: KVCache) -> None:
    """Runs the decode attention once against ``cache`` (reads block 0, writes nothing), so a
    compiled method compiles for this cache at load rather than on the first request."""
    if "compiled" not in (choice.method, choice.small_method):
        return
    bs, dev = cache.block_size, spec.device
    q = torch.zeros(2, spec.num_heads, spec.head_dim, dtype=spec.dtype, device=dev)
    meta = PagedDecodeMeta(block_ids=torch.zeros(4, dtype=torch.long, device=dev),
                           bias=torch.zeros(2, 1, 2 * bs, device=dev), batch=2, n_blocks=2)
    paged_decode_attention(q, cache.k[0], cache.v[0], meta, Workspace(), spec.layers[0].scale, "compiled")
