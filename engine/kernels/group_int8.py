"""Weight-only int8 with one scale per group of inputs: GGUF's Q8_0 as the file stores it.

Owns: `GroupQuantized`, a linear weight kept as int8 values with a scale per group of ``group``
consecutive inputs of each output row (``W[o, i] = q[o, i] * scale[o, i // group]``; Q8_0: groups
of 32, fp16 scales), and `GroupInt8Linear`, its kernel.

Why not `engine.kernels.quant.Int8Linear`: that kernel has one scale per output row, and a Q8_0 row has a
scale per 32 inputs; requantizing a row to one scale would round every block again. This kernel
multiplies by the file's own weights. And why the RMSNorm gain is not folded into the weight, as
the dense fast path does: a gain multiplies input columns, which neither an int8 value nor a
scale shared by 32 columns can absorb exactly, so the kernel keeps the gain and applies it to the
normed activations (``gain * norm(x)``: transformers' Llama order).

How: this kernel dequantizes tiles of output rows (`rows_per_tile`, a bounded scratch) and runs a
dense matmul per tile, which suits prefill chunks; decode rows go to the C++ kernel over the same
int8 values and scales where it builds (`engine.kernels.native_linear`, ``csrc/small_linear_group.h``: exact
integer sums per group over the activations rounded to int16, then the group's scale), which reads
the int8 weight alone (1 + 4/32 bytes a value). fp32 activations here multiply the exact weights
(``q * scale`` is exact in fp32: 8 + 11 significant bits); bf16 activations multiply them rounded to
bf16 where this CPU has bf16 matmul kernels, else in fp32 (as `engine.kernels.quant.UpcastLinear`), the
result rounded to bf16.

Invariants: ``q`` is int8 ``[out, in]``, ``scale`` fp32 ``[out, in // group]`` with ``in % group
== 0``; fused weights (qkv, gate_up) are their parts' rows stacked, each row with its own groups
(`engine.loading.weights`); the kernel keeps no per-call state.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from engine.kernels import native_rows
from engine.kernels.quant import CpuLinear, onednn_packing_available


@dataclass(frozen=True)
class GroupQuantized:
    """A linear weight ``[out, in]`` as int8 values and a scale per ``group`` inputs of a row; ``gain``:
    an RMSNorm gain ``[in]`` the kernel applies to its normed input (`engine.model.layer.fold`), or None."""

    q: torch.Tensor  # [out, in] int8
    scale: torch.Tensor  # [out, in // group] fp32
    group: int
    gain: torch.Tensor | None = None  # [in]

    def __post_init__(self) -> None:
        out, n = self.q.shape
        if self.q.dtype != torch.int8 or self.group < 1 or n % self.group or tuple(self.scale.shape) != (
                out, n // self.group):
            raise ValueError(f"group-quantized weight: q {self.q.dtype} {tuple(self.q.shape)} with scale "
                             f"{tuple(self.scale.shape)} is not int8 [out, in] with a scale per {self.group} inputs")

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dequantize(self, dtype: torch.dtype = torch.float32, rows: slice = slice(None)) -> torch.Tensor:
        """``q * scale`` of ``rows`` ``[n, in]`` in ``dtype`` (exact in fp32), without the gain."""
        q, s = self.q[rows], self.scale[rows]
        w = torch.mul(q.view(q.shape[0], -1, self.group), s.unsqueeze(-1))  # [n, G, group] fp32
        return w.view(q.shape).to(dtype)

    def with_gain(self, gain: torch.Tensor | None) -> GroupQuantized:
        return replace(self, gain=gain)


class GroupInt8Linear(CpuLinear):
    """The kernel of a `GroupQuantized` weight (see the module docstring)."""

    tile_bytes = 8 << 20  # the dequantized scratch of one tile of output rows (fp32)

    def __init__(self, weight: GroupQuantized, bias: torch.Tensor | None = None) -> None:
        super().__init__(weight.q, bias)
        self.packed = weight
        self.gain = weight.gain
        self.rows_per_tile = max(1, self.tile_bytes // (4 * self.in_features))

    @property
    def nbytes(self) -> int:
        w = self.packed
        tensors = [w.q, w.scale] + [t for t in (self.bias, self.gain) if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x: [T, in] → [T, out] (+ residual [T, out]), in x's dtype."""
        dt = x.dtype if x.dtype == torch.bfloat16 and onednn_packing_available(torch.bfloat16) else torch.float32
        xc = x.to(dt)
        outs = []
        for o in range(0, self.out_features, self.rows_per_tile):
            rows = slice(o, o + self.rows_per_tile)
            bias = None if self.bias is None else self.bias[rows].to(dt)
            outs.append(F.linear(xc, self.packed.dequantize(dt, rows), bias))  # [T, tile]
        y = (torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]).to(x.dtype)
        return y if residual is None else residual + y

    def normed(self, x: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm of x, times the gain where the weight carries one, then the product."""
        h = native_rows.rms_norm(x, eps)  # [T, in]
        return self(h if self.gain is None else self.gain.to(h.dtype) * h)


#: A linear weight as the loader gives it: dense ``[out, in]``, or kept group-quantized (`GroupQuantized`).
Weight = torch.Tensor | GroupQuantized
