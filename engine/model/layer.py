"""One decoder layer's pieces that the forward (`engine.model.model`) calls: its weights as kernels
(`LayerKernels`), an RMSNorm followed by a linear kernel (`NormedLinear`), and RMSNorm itself in both
families' orders.

The model is built with plain kernels (`plain_linear`: ``F.linear``, transformers' op order, any
device); a backend may swap them after the build for its own formats (`engine.attention.base`:
``prepare_model``), e.g. the CPU backend's folded, packed or int8 kernels. Whatever the swap, a
`NormedLinear` is called the same way, so the forward never knows which kernel runs.

Invariants: nothing here keeps per-request state; `rms_norm` matches transformers' Llama and Gemma
norms op for op.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from engine.kernels.group_int8 import GroupInt8Linear, GroupQuantized, Weight
from engine.kernels.quant import Linear
from engine.loading.weights import LayerWeights


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, gain_in_fp32: bool = False) -> torch.Tensor:
    """Matches transformers' LlamaRMSNorm: normalize in fp32, cast back, then scale; with
    ``gain_in_fp32`` its GemmaRMSNorm (``weight`` being ``1 + w``): scale in fp32, then cast back."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if gain_in_fp32:
        return (xf * weight.float()).to(dtype)
    return weight * xf.to(dtype)


def plain_linear(weight: Weight, bias: torch.Tensor | None = None) -> Linear:
    """The build-time kernel of a weight: ``F.linear`` over it (a group-quantized weight dequantized
    tile by tile, `engine.kernels.group_int8`)."""
    return GroupInt8Linear(weight, bias) if isinstance(weight, GroupQuantized) else Linear(weight, bias)


class NormedLinear:
    """``kernel(RMSNorm(x) * gain)``: a norm and the linear layer that reads it (qkv after the input
    norm, gate_up after the post-attention norm, the lm_head after the final norm).

    ``folded``: the gain is already in the kernel's weight (``W @ (g * x) == (W * g) @ x``), so the
    kernel's own gain-less `Linear.normed` runs; a backend sets it when it folds (`fold_gain`).
    """

    def __init__(self, gain: torch.Tensor, kernel: Linear, eps: float, gain_in_fp32: bool = False,
                 folded: bool = False) -> None:
        self.gain = gain  # [in]
        self.kernel = kernel
        self.eps = eps
        self.gain_in_fp32 = gain_in_fp32
        self.folded = folded

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] → [T, out]."""
        if self.folded:
            return self.kernel.normed(x, self.eps)
        return self.kernel(rms_norm(x, self.gain, self.eps, self.gain_in_fp32))


def fold_gain(w: Weight, gain: torch.Tensor) -> Weight:
    """W * g (the gain folded into the weight's input columns). A group-quantized weight cannot take
    g exactly (g varies within a group): it carries g to its kernel instead (`engine.kernels.group_int8`)."""
    if isinstance(w, GroupQuantized):
        return w.with_gain(gain)
    return (w.float() * gain.float()).to(w.dtype)


@dataclass
class LayerKernels:
    attn_in: NormedLinear  # input norm, then qkv: [hidden] → [q_size + 2 * kv_size]
    o_proj: Linear  # [q_size] → [hidden]
    mlp_in: NormedLinear  # post-attention norm, then gate_up: [hidden] → [2 * intermediate]
    down: Linear  # [intermediate] → [hidden]
    q_norm: torch.Tensor | None = None  # [head_dim]: RMSNorm gain over each head of q before RoPE (Qwen3)
    k_norm: torch.Tensor | None = None  # [head_dim]
    attn_out_norm: torch.Tensor | None = None  # [hidden]: on o_proj's output before the residual add (Gemma)
    mlp_out_norm: torch.Tensor | None = None  # [hidden]: on down's output before the residual add (Gemma)

    def linears(self) -> tuple[Linear, Linear, Linear, Linear]:
        """qkv, o_proj, gate_up, down."""
        return self.attn_in.kernel, self.o_proj, self.mlp_in.kernel, self.down


def plain_layer(lw: LayerWeights, eps: float, gain_in_fp32: bool) -> LayerKernels:
    """A layer's plain kernels over its loaded weights (no copy)."""
    return LayerKernels(
        attn_in=NormedLinear(lw.input_norm, plain_linear(lw.qkv, lw.qkv_bias), eps, gain_in_fp32),
        o_proj=plain_linear(lw.o_proj),
        mlp_in=NormedLinear(lw.post_norm, plain_linear(lw.gate_up), eps, gain_in_fp32),
        down=plain_linear(lw.down),
        q_norm=lw.q_norm, k_norm=lw.k_norm, attn_out_norm=lw.attn_out_norm, mlp_out_norm=lw.mlp_out_norm,
    )


def offset_gains(lw: LayerWeights) -> LayerWeights:
    """``lw`` with each norm's gain ``w`` as an offset norm multiplies by it: ``1 + w`` in fp32 (Gemma)."""
    def offset(w: torch.Tensor | None) -> torch.Tensor | None:
        return None if w is None else 1.0 + w.float()

    return replace(lw, input_norm=1.0 + lw.input_norm.float(), post_norm=1.0 + lw.post_norm.float(),
                   q_norm=offset(lw.q_norm), k_norm=offset(lw.k_norm), attn_out_norm=offset(lw.attn_out_norm),
                   mlp_out_norm=offset(lw.mlp_out_norm))
