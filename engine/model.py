"""The Llama-family forward pass (Llama, Mistral, Qwen2, SmolLM) over the paged KV cache.

Owns: one forward for a *batch of prefill chunks* (each sequence may start after cached prefix
tokens) and one for a *batched decode step* (one token per sequence, contexts of any length).
Batch preparation (positions, slots) is the caller's (`engine.runner`); this module only computes.

Invariants: every sequence in a batch is independent (its result does not depend on the others
beyond float reassociation); the KV of every input token is written to its slot before attention
reads it; logits come back in fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention import decode_attention, prefill_attention, write_kv
from engine.config import ModelConfig
from engine.kv_cache import KVCache
from engine.rope import RotaryEmbedding
from engine.weights import LayerWeights, ModelWeights


@dataclass
class PrefillBatch:
    """Flattened inputs of several prefill chunks (built by `engine.runner`)."""

    token_ids: torch.Tensor  # [T] all chunks' tokens, concatenated
    positions: torch.Tensor  # [T]
    slots: torch.Tensor  # [T] cache slot of each token
    seq_lens: list[int]  # tokens of each chunk; sums to T
    start_positions: list[int]  # cached tokens before each chunk
    context_slots: list[torch.Tensor | None]  # per chunk: [start + len] slots, or None if start == 0
    logits_index: torch.Tensor  # [N] rows of T whose logits are wanted


@dataclass
class DecodeBatch:
    token_ids: torch.Tensor  # [B]
    positions: torch.Tensor  # [B]
    slots: torch.Tensor  # [B] slot of the new token
    slot_table: torch.Tensor  # [B, L] context slots, padded
    valid: torch.Tensor  # [B, L] bool


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Matches transformers' LlamaRMSNorm: normalize in fp32, cast back, then scale."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


class LlamaModel:
    """Weights + the two forwards. Holds no per-request state."""

    def __init__(self, cfg: ModelConfig, weights: ModelWeights, max_positions: int) -> None:
        self.cfg = cfg
        self.w = weights
        self.device = weights.embed.device
        self.dtype = weights.embed.dtype
        self.rope = RotaryEmbedding(cfg, max_positions, self.device)
        self.scale = cfg.head_dim**-0.5

    def _qkv(self, lw: LayerWeights, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        cfg = self.cfg
        t = x.shape[0]
        qkv = F.linear(x, lw.qkv, lw.qkv_bias)  # [T, q + 2kv]
        q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q = q.view(t, cfg.num_heads, cfg.head_dim)  # [T, H, D]
        k = k.view(t, cfg.num_kv_heads, cfg.head_dim)  # [T, KV, D]
        v = v.view(t, cfg.num_kv_heads, cfg.head_dim)
        q, k = self.rope.apply(q, k, positions)
        return q, k, v

    def _mlp(self, lw: LayerWeights, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, lw.gate_up).chunk(2, dim=-1)  # [T, I] each
        return F.linear(F.silu(gate) * up, lw.down)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        h = rms_norm(h, self.w.norm, self.cfg.rms_norm_eps)
        return F.linear(h, self.w.lm_head).float()  # [N, vocab]

    @torch.inference_mode()
    def prefill(self, batch: PrefillBatch, cache: KVCache) -> torch.Tensor:
        """Returns fp32 logits [N, vocab] for the rows in ``batch.logits_index``."""
        cfg = self.cfg
        h = self.w.embed[batch.token_ids]  # [T, hidden]
        for li, lw in enumerate(self.w.layers):
            x = rms_norm(h, lw.input_norm, cfg.rms_norm_eps)
            q, k, v = self._qkv(lw, x, batch.positions)
            write_kv(cache.k[li], cache.v[li], batch.slots, k, v)
            outs = []
            offset = 0
            for n, start, ctx in zip(batch.seq_lens, batch.start_positions, batch.context_slots, strict=True):
                sl = slice(offset, offset + n)
                outs.append(
                    prefill_attention(q[sl], k[sl], v[sl], cache.k[li], cache.v[li], start, ctx, self.scale)
                )
                offset += n
            attn = torch.cat(outs) if len(outs) > 1 else outs[0]  # [T, H, D]
            h = h + F.linear(attn.reshape(attn.shape[0], cfg.q_size), lw.o_proj)
            h = h + self._mlp(lw, rms_norm(h, lw.post_norm, cfg.rms_norm_eps))
        return self._logits(h[batch.logits_index])

    @torch.inference_mode()
    def decode(self, batch: DecodeBatch, cache: KVCache) -> torch.Tensor:
        """Returns fp32 logits [B, vocab], one row per sequence."""
        cfg = self.cfg
        h = self.w.embed[batch.token_ids]  # [B, hidden]
        b = h.shape[0]
        for li, lw in enumerate(self.w.layers):
            x = rms_norm(h, lw.input_norm, cfg.rms_norm_eps)
            q, k, v = self._qkv(lw, x, batch.positions)
            write_kv(cache.k[li], cache.v[li], batch.slots, k, v)
            attn = decode_attention(q, cache.k[li], cache.v[li], batch.slot_table, batch.valid, self.scale)
            h = h + F.linear(attn.reshape(b, cfg.q_size), lw.o_proj)
            h = h + self._mlp(lw, rms_norm(h, lw.post_norm, cfg.rms_norm_eps))
        return self._logits(h)
