"""The ``reference`` attention backend: plain torch in transformers' order, on any device.

Owns: the oracle every other backend is tested against. RoPE is applied layer by layer from the
float32 tables (`RotaryEmbedding.apply`), k and v are stored slot by slot, a prefill chunk attends
with SDPA (``is_causal`` from position 0, else over its context gathered slot by slot with a bool
mask), a decode row over its gathered context slots with a bool mask; soft-capped layers form the
scores explicitly (transformers' eager order: scale, cap, mask, fp32 softmax).

Invariants: those of `engine.attention.base`; nothing is fused, packed or compiled, so a
difference between another backend and this one is that backend's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention.base import AttentionBackend, AttentionSpec, decode_call_lengths, prefill_call_lengths
from engine.attention.ops import decode_attention, prefill_attention, visible_keys, write_kv
from engine.batch import DecodeBatch, PrefillBatch
from engine.config import EngineConfig
from engine.kv_cache import KVCache


@dataclass
class _Chunk:
    rows: slice  # the chunk's rows of the packed batch
    start: int  # cached positions before it
    context_slots: torch.Tensor | None  # [start + len] slots of positions 0..end-1, None when start == 0


@dataclass
class ReferencePrefill:
    positions: torch.Tensor  # [T]
    slots: torch.Tensor  # [T]
    lens: torch.Tensor | None  # [T] forward-call lengths (length-dependent RoPE) or None
    chunks: list[_Chunk]


@dataclass
class ReferenceDecode:
    positions: torch.Tensor  # [B]
    slots: torch.Tensor  # [B]
    lens: torch.Tensor | None  # [B]
    slot_table: torch.Tensor  # [B, L] every row's context slots, padded (masked by ``cols``)
    cols: torch.Tensor  # [L] positions 0..L-1


class ReferenceBackend(AttentionBackend):
    name = "reference"

    @classmethod
    def unavailable(cls, spec: AttentionSpec, config: EngineConfig) -> str | None:
        if config.quantization is not None:
            return f"quantization={config.quantization!r} is the cpu backend's (the reference runs the loaded weights)"
        return None

    def prepare_prefill(self, batch: PrefillBatch, cache: KVCache) -> ReferencePrefill:
        bs, chunks, offset = cache.block_size, [], 0
        for n, start, table in zip(batch.seq_lens, batch.start_positions, batch.block_tables, strict=True):
            slots = None
            if start > 0:
                pos = torch.arange(start + n, device=table.device)
                slots = table[pos // bs] * bs + pos % bs  # [start + n]
            chunks.append(_Chunk(slice(offset, offset + n), start, slots))
            offset += n
        return ReferencePrefill(batch.positions, batch.slots, prefill_call_lengths(self.spec, batch), chunks)

    def prepare_decode(self, batch: DecodeBatch, cache: KVCache) -> ReferenceDecode:
        bs = cache.block_size
        cols = torch.arange(max(batch.context_lens), device=batch.positions.device)  # [L]
        slot_table = batch.block_table[:, cols // bs] * bs + cols % bs  # [B, L]
        return ReferenceDecode(batch.positions, batch.slots, decode_call_lengths(self.spec, batch), slot_table, cols)

    def forward(self, layer: int, qkv: torch.Tensor, cache: KVCache, meta: object) -> torch.Tensor:
        assert isinstance(meta, ReferencePrefill | ReferenceDecode)
        la = self.spec.layers[layer]
        q, k, v = self.spec.split(qkv)  # [T, H, D], [T, KV, D], [T, KV, D]
        q, k = self.spec.ropes[la.rope].rope.apply(q, k, meta.positions, meta.lens)
        kc, vc = cache.k[layer], cache.v[layer]
        write_kv(kc, vc, meta.slots, k, v)
        t = qkv.shape[0]
        if isinstance(meta, ReferenceDecode):
            seen = visible_keys(meta.positions.unsqueeze(1), meta.cols.unsqueeze(0), la.window)  # [B, L]
            return decode_attention(q, kc, vc, meta.slot_table, seen, la.scale, la.softcap).reshape(t, -1)
        outs = [prefill_attention(q[c.rows], k[c.rows], v[c.rows], kc, vc, c.start, c.context_slots, la.scale,
                                  window=la.window, softcap=la.softcap) for c in meta.chunks]
        attn = torch.cat(outs) if len(outs) > 1 else outs[0]  # [T, H, D]
        return attn.reshape(t, -1)


BACKEND = ReferenceBackend
