"""The oracle a backend's layer forward is compared against, from the reference ops.

Owns: `reference_prefill` and `reference_decode`: one layer's attention output and the cache after
it, computed with `RotaryEmbedding.apply` (transformers' ``rotate_half`` form, not the backends'
rolled tables; a length-dependent RoPE's table from the prompt's whole length in a prefill, from
position + 1 in decode), `write_kv` into copies of the cache, `prefill_attention` over the chunk's context
slots one chunk at a time, and `decode_attention` over each row's gathered slots.
"""

from __future__ import annotations

import torch

from engine.attention.base import AttentionSpec
from engine.attention.ops import decode_attention, prefill_attention, visible_keys, write_kv
from engine.batch import DecodeBatch, PrefillBatch
from engine.kv_cache import KVCache
from tests.support.paged_batches import slots_of

Result = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # out [T, H * D], k cache, v cache


def _rotated(spec: AttentionSpec, layer: int, qkv: torch.Tensor, positions: torch.Tensor, lens: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k rotated by the table of each token's forward-call length ``lens`` [T] where the RoPE reads it."""
    q, k, v = spec.split(qkv)
    q, k = spec.ropes[spec.layers[layer].rope].rope.apply(q, k, positions, lens if spec.length_dependent else None)
    return q, k, v


def reference_prefill(spec: AttentionSpec, layer: int, qkv: torch.Tensor, cache: KVCache,
                      batch: PrefillBatch) -> Result:
    rule = spec.layers[layer]
    lens = torch.tensor(batch.prompt_lens).repeat_interleave(torch.tensor(batch.seq_lens))  # a prompt's whole length
    q, k, v = _rotated(spec, layer, qkv, batch.positions, lens)
    kc, vc = cache.k[layer].clone(), cache.v[layer].clone()
    write_kv(kc, vc, batch.slots, k, v)
    outs = []
    parts = zip(q.split(batch.seq_lens), k.split(batch.seq_lens), v.split(batch.seq_lens), batch.block_tables,
                batch.start_positions, strict=True)
    for qc, kn, vn, table, start in parts:
        context = slots_of(table, torch.arange(start + qc.shape[0]), cache.block_size)
        outs.append(prefill_attention(qc, kn, vn, kc, vc, start, context, rule.scale, window=rule.window,
                                      softcap=rule.softcap))
    return torch.cat(outs).flatten(1), kc, vc


def reference_decode(spec: AttentionSpec, layer: int, qkv: torch.Tensor, cache: KVCache,
                     batch: DecodeBatch) -> Result:
    rule = spec.layers[layer]
    q, k, v = _rotated(spec, layer, qkv, batch.positions, batch.positions + 1)
    kc, vc = cache.k[layer].clone(), cache.v[layer].clone()
    write_kv(kc, vc, batch.slots, k, v)
    length = int(batch.positions.max()) + 1
    k_pos = torch.arange(length)
    slot_table = torch.stack([slots_of(t, k_pos.clamp(max=int(p)), cache.block_size)
                              for t, p in zip(batch.block_table, batch.positions, strict=True)])  # [B, L]
    valid = visible_keys(batch.positions.unsqueeze(1), k_pos.unsqueeze(0), rule.window)  # [B, L]
    out = decode_attention(q, kc, vc, slot_table, valid, rule.scale, softcap=rule.softcap)
    return out.flatten(1), kc, vc
