"""One decoder layer's pieces that the forwards (`engine.model.model`) share: its weights in their
kernels' formats (`LayerKernels`, built one class of linears at a time by `build_layer_kernels`, norm
gains folded into the next weight on the fast path, or carried by a group-quantized one's kernel),
RMSNorm in both families' orders, a forward's RoPE per table (`Rotation`) and a windowed layer's
decode metadata (`windowed_meta`).

Invariants: nothing here keeps per-request state; `rms_norm` matches transformers' Llama and Gemma
norms op for op.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from engine.attention.ops import PagedDecodeMeta, visible_keys
from engine.kernels.group_int8 import GroupQuantized, Weight
from engine.kernels.kernel_choice import KernelChoice, build_linears
from engine.kernels.native_rope import RopeStore
from engine.kernels.quant import Linear
from engine.loading.weights import LayerWeights


@dataclass
class Rotation:
    """One forward's RoPE, one entry per table of `LlamaModel.ropes` (a layer's is ``LayerKernels.rope``):
    the native stores, or the eager fast path's gathered (cos, signed sin) [T, 1, R]; empty where unused.
    ``lens`` [T]: each token's forward-call length, for a length-dependent RoPE (else None)."""

    tables: list[tuple[torch.Tensor, torch.Tensor]]
    stores: list[RopeStore | None]
    lens: torch.Tensor | None = None


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


def fold(w: Weight, norm: torch.Tensor | None, fast: bool) -> Weight:
    """W @ (g * x) == (W * g) @ x: the fast path folds the RMSNorm gain g into the next weight. A
    group-quantized weight cannot take g exactly (g varies within a group): it carries g to its
    kernel, which multiplies the normed activations by it (`engine.kernels.group_int8`)."""
    if not fast or norm is None:
        return w
    if isinstance(w, GroupQuantized):
        return w.with_gain(norm)
    return (w.float() * norm.float()).to(w.dtype)


def build_layer_kernels(lws: Sequence[LayerWeights], ropes: Sequence[int], *, fast: bool, quantization: str | None,
                        mode: str) -> tuple[list[LayerKernels], list[KernelChoice]]:
    """Every layer's kernels (``ropes[i]``: layer i's RoPE table) and the choices behind them.

    One class of linears at a time (so `engine.kernels.kernel_choice` can time a class as a step streams
    it); the loaded tensors are not kept where a packed or int8 kernel replaces them."""
    none: list[torch.Tensor | None] = [None] * len(lws)
    classes: dict[str, Callable[[], tuple[list[Weight], list[torch.Tensor | None]]]] = {
        "qkv": lambda: ([fold(lw.qkv, lw.input_norm, fast) for lw in lws], [lw.qkv_bias for lw in lws]),  # Qwen2
        "o_proj": lambda: ([lw.o_proj for lw in lws], none),
        "gate_up": lambda: ([fold(lw.gate_up, lw.post_norm, fast) for lw in lws], none),
        "down": lambda: ([lw.down for lw in lws], none),
    }
    choices: list[KernelChoice] = []
    built: dict[str, list[Linear]] = {}
    for name, make in classes.items():  # folded copies of one class at a time
        built[name], choice = build_linears(name, *make(), fast=fast, quantization=quantization, mode=mode)
        if choice is not None:
            choices.append(choice)
    layers = [
        LayerKernels(input_norm=lw.input_norm, qkv=built["qkv"][i], o_proj=built["o_proj"][i], post_norm=lw.post_norm,
                     gate_up=built["gate_up"][i], down=built["down"][i], q_norm=lw.q_norm, k_norm=lw.k_norm,
                     attn_out_norm=lw.attn_out_norm, mlp_out_norm=lw.mlp_out_norm, rope=ropes[i])
        for i, lw in enumerate(lws)
    ]
    return layers, choices


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
