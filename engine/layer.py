"""One decoder layer's pieces that the forwards (`engine.model`) share: its weights in their
kernels' formats (`LayerKernels`), RMSNorm in both families' orders, a forward's RoPE per table
(`Rotation`) and a windowed layer's decode metadata (`windowed_meta`).

Invariants: nothing here keeps per-request state; `rms_norm` matches transformers' Llama and Gemma
norms op for op.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from engine.attention import PagedDecodeMeta, visible_keys
from engine.native_rope import RopeStore
from engine.quant import Linear
from engine.weights import LayerWeights


@dataclass
class Rotation:
    """One forward's RoPE, one entry per table of `LlamaModel.ropes` (a layer's is ``LayerKernels.rope``):
    the native stores, or the eager fast path's gathered (cos, signed sin) [T, 1, D]; empty where unused."""

    tables: list[tuple[torch.Tensor, torch.Tensor]]
    stores: list[RopeStore | None]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, gain_in_fp32: bool = False) -> torch.Tensor:
    """Matches transformers' LlamaRMSNorm: normalize in fp32, cast back, then scale; with
    ``gain_in_fp32`` its GemmaRMSNorm (``weight`` being ``1 + w``): scale in fp32, then cast back."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if gain_in_fp32:
        return (xf * weight.float()).to(dtype)
    return weight * xf.to(dtype)


@dataclass
class LayerKernels:
    input_norm: torch.Tensor  # [hidden]
    qkv: Linear  # [hidden] → [q_size + 2 * kv_size]
    o_proj: Linear  # [q_size] → [hidden]
    post_norm: torch.Tensor  # [hidden]
    gate_up: Linear  # [hidden] → [2 * intermediate]
    down: Linear  # [intermediate] → [hidden]
    q_norm: torch.Tensor | None = None  # [head_dim]: RMSNorm gain over each head of q before RoPE (Qwen3)
    k_norm: torch.Tensor | None = None  # [head_dim]
    attn_out_norm: torch.Tensor | None = None  # [hidden]: on o_proj's output before the residual add (Gemma)
    mlp_out_norm: torch.Tensor | None = None  # [hidden]: on down's output before the residual add (Gemma)
    rope: int = 0  # index of the layer's RoPE tables in `LlamaModel.ropes`


def offset_gains(lw: LayerWeights) -> LayerWeights:
    """``lw`` with each norm's gain ``w`` as an offset norm multiplies by it: ``1 + w`` in fp32 (Gemma)."""
    def offset(w: torch.Tensor | None) -> torch.Tensor | None:
        return None if w is None else 1.0 + w.float()

    return replace(lw, input_norm=1.0 + lw.input_norm.float(), post_norm=1.0 + lw.post_norm.float(),
                   q_norm=offset(lw.q_norm), k_norm=offset(lw.k_norm), attn_out_norm=offset(lw.attn_out_norm),
                   mlp_out_norm=offset(lw.mlp_out_norm))


def windowed_meta(meta: PagedDecodeMeta, window: int) -> PagedDecodeMeta:
    """``meta`` for a layer that sees only the last ``window`` positions (its own included): the
    earlier ones masked in the bias too; its lengths stay the full ones (only the bias carries the
    window, so the caller must not pick a method that reads lengths alone)."""
    pos = meta.visible() - 1  # [B]
    cols = torch.arange(meta.bias.shape[-1], device=meta.bias.device)  # [L]
    hidden = ~visible_keys(pos.unsqueeze(1), cols.unsqueeze(0), window).unsqueeze(1)  # [B, 1, L] (later ones too)
    return PagedDecodeMeta(block_ids=meta.block_ids, bias=meta.bias.masked_fill(hidden, float("-inf")),
                           batch=meta.batch, n_blocks=meta.n_blocks, lengths=pos + 1)
