"""Linear-layer weight formats and their CPU kernels: plain, oneDNN-prepacked, weight-only int8.

Owns: how one linear layer's weight ``W: [out, in]`` is stored for the fastest kernel on this
device, ``y = x @ W.T (+ bias) (+ residual)`` computed from that storage, and symmetric
per-output-channel int8 quantization (``quantize_int8`` / ``dequantize_int8``).

Why several formats: which kernel reads a weight fastest depends on the CPU and the row count
(BLAS's matrix-vector product, oneDNN on the plain layout, oneDNN on its prepacked layout, which
in bf16 saves re-packing the weight on every call), so `PackedLinear` offers two layouts and
`engine.kernels.kernel_choice` times them on the machine at load. ``aten._weight_int8pack_mm`` (int8
weight, bf16 activations) reads half the bytes of bf16 but is not bandwidth bound on small
matrices; above `Int8Linear.int8_mm_max_rows` rows (prefill) it dequantizes and runs a dense bf16
matmul instead. Figures: results/engine.json and docs/benchmarks-notes.md.

Invariants: every kernel computes ``F.linear(x, W, bias) (+ residual)`` up to float
reassociation (dense) or up to the int8 rounding of ``W`` (``|W - dequantize(q, s)| <= s / 2``
per element, ``s = max|W[row]| / 127``); inputs are 2-D ``[rows, in]``; kernels are immutable after
construction and keep no per-call state, so one model may serve several threads.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from engine.kernels import native_rows

QUANTIZATION_MODES = ("int8",)


class Linear:
    """Reference kernel: the weight as loaded, ``F.linear``, torch ops only (any device). Also the
    base of the CPU kernels (`CpuLinear`)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight = weight  # [out, in]
        self.bias = bias  # [out] or None
        self.out_features, self.in_features = weight.shape

    @property
    def nbytes(self) -> int:
        """Bytes a forward reads for the weight (and bias): the decode roofline's numerator."""
        n = self.weight.numel() * self.weight.element_size()
        return n + (self.bias.numel() * self.bias.element_size() if self.bias is not None else 0)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x: [T, in] → [T, out] (+ residual [T, out])."""
        y = F.linear(x, self.weight, self.bias)
        return y if residual is None else residual + y

    def normed(self, x: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm of x without a gain (a folded kernel carries it in its weight), then this kernel:
        x [T, in] → [T, out]."""
        return self(F.rms_norm(x, (x.shape[-1],), None, eps))

    def glu(self, gate_up: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """silu(gate) * up of ``gate_up [T, 2 * in]`` (transformers' ops), then this kernel (+ residual)."""
        gate, up = gate_up.chunk(2, dim=-1)  # [T, in] each
        return self(F.silu(gate) * up, residual)


class CpuLinear(Linear):
    """`Linear` with its prologues (gain-less RMSNorm, silu(gate) * up) as one C++ pass each
    (`engine.kernels.native_rows`, torch ops where it does not build): the base of the CPU kernels."""

    def normed(self, x: torch.Tensor, eps: float) -> torch.Tensor:
        return self(native_rows.rms_norm(x, eps))

    def glu(self, gate_up: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        return self(native_rows.glu(gate_up), residual)


@functools.cache
def onednn_packing_available(dtype: torch.dtype) -> bool:
    """Whether this torch build can prepack a linear weight of ``dtype`` for oneDNN (checked once)."""
    try:
        w = torch.randn(8, 16).to(dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 1)
        y = torch.ops.mkldnn._linear_pointwise(torch.ones(1, 16, dtype=dtype), packed, None, "none", [], "")
        return bool(torch.allclose(y.float(), w.float().sum(1, keepdim=True).T, atol=1e-1, rtol=1e-2))
    except (RuntimeError, AttributeError):
        return False


class PackedLinear(CpuLinear):
    """oneDNN inner product (residual add fused as a post-op), in one of two weight formats.

    - ``"packed"``: the weight is reordered once into oneDNN's blocked layout (``self.weight`` is
      then an opaque oneDNN tensor) and every row count runs through oneDNN.
    - ``"plain"``: the weight stays a plain ``[out, in]`` tensor; one row (a batch-1 decode step)
      runs as a BLAS matrix-vector product (``addmm``), more rows through oneDNN on the plain layout.
      Which is faster depends on the CPU, so which format a model gets is measured on the machine at
      load (`engine.kernels.kernel_choice`).

    Only for CPU fp32/bf16 weights where `onednn_packing_available` holds (use `make_linear`).
    """

    FORMATS = ("packed", "plain")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, rows_hint: int = 1,
                 fmt: str = "packed") -> None:
        if fmt not in self.FORMATS:
            raise ValueError(f"unknown linear format {fmt!r}; expected one of {self.FORMATS}")
        super().__init__(weight, bias)
        self.format = fmt
        self._plain_nbytes = super().nbytes
        self._blas_rows = 1 if fmt == "plain" else 0
        if fmt == "packed":
            # rows_hint only tunes the blocking oneDNN picks; any row count is correct.
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, rows_hint)

    @property
    def nbytes(self) -> int:
        return self._plain_nbytes

    # oneDNN builds (and caches, up to 1024 entries) one primitive per input row count, ~0.5 MB
    # each: prefill's ever-new row counts would make a replica's memory creep for as long as it
    # serves. So up to `exact_rows` rows (decode batches) run as they are; more rows run in tiles of
    # `row_tile`, the last one padded up to a multiple of `row_quantum`. Row counts seen by oneDNN:
    # 1..64, 128, 192, ..., 512 -- a fixed set of 72, reached in the first minutes; the price is the
    # padded rows and one copy joining the tiles' outputs.
    exact_rows = 64
    row_tile = 512
    row_quantum = 64

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.shape[0]
        if rows <= self._blas_rows:
            return self._blas(x, residual)
        if rows <= self.exact_rows:
            return self._mm(x, residual)
        outs = []
        for s in range(0, rows, self.row_tile):
            xs = x[s : s + self.row_tile]  # [n, in]
            rs = residual[s : s + self.row_tile] if residual is not None else None  # [n, out]
            n = xs.shape[0]
            if pad := -n % self.row_quantum:
                xs = F.pad(xs, (0, 0, 0, pad))
                rs = F.pad(rs, (0, 0, 0, pad)) if rs is not None else None
            outs.append(self._mm(xs, rs)[:n])
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _blas(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """Plain format, one row: ``x [1, in] @ W.T`` as a BLAS gemv, bias and residual in its beta term."""
        if residual is None:
            return F.linear(x, self.weight, self.bias)
        if self.bias is not None:
            residual = residual + self.bias
        return torch.addmm(residual, x, self.weight.t())

    def _mm(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        if residual is None:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.weight, self.bias, "add")


class UpcastLinear(CpuLinear):
    """bf16 weight on a CPU without bf16 matmul kernels (no AVX-512 BF16/AVX-NE-CONVERT: oneDNN cannot
    prepack it, and ``F.linear`` in bf16 there runs at a small fraction of fp32's rate, see
    docs/benchmarks-notes.md): ``upcast_min_rows`` rows or more run in fp32 on a copy of the weight
    upcast for the call (a read and a write of the weight: small next to a prefill's FLOPs), the
    result rounded back to bf16; fewer rows run as ``F.linear`` in bf16, where the weight read is the
    cost. The stored weight stays bf16, so nothing is kept twice."""

    upcast_min_rows = 8

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if x.shape[0] < self.upcast_min_rows:
            return super().__call__(x, residual)
        bias = None if self.bias is None else self.bias.float()
        y = F.linear(x.float(), self.weight.float(), bias)  # [T, out] fp32
        if residual is not None:
            y += residual
        return y.to(x.dtype)


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: ``weight [out, in]`` → ``(q int8 [out, in], scale fp32 [out])``.

    ``scale = max|row| / 127`` (an all-zero row gets scale 1), ``q = round(w / scale)`` in [-127, 127],
    so ``|w - q * scale| <= scale / 2`` elementwise.
    """
    w = weight.float()
    scale = w.abs().amax(dim=1) / 127.0  # [out]
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of `quantize_int8` up to its rounding: ``[out, in]`` in ``dtype``."""
    return (q.float() * scale[:, None]).to(dtype)


class Int8Linear(CpuLinear):
    """Weight-only int8: int8 weight + per-channel scales; activations are computed in bf16.

    Up to ``int8_mm_max_rows`` rows (decode): ``aten._weight_int8pack_mm`` reads the int8 weight
    directly. More rows (prefill): dequantize to bf16 and run a dense matmul, where compute, not the
    weight read, is the cost (in fp32 where this CPU has no bf16 matmul kernels, as `UpcastLinear`).
    fp32 activations are cast to bf16 and the result back. ``in_features`` not a multiple of 16 always
    takes the dense path: torch 2.13's AVX-512 ``_weight_int8pack_mm`` crashes the process (SIGSEGV)
    on 2 or more rows of such a width (its AVX2 path runs it fine).
    """

    int8_mm_max_rows = 16  # below the row count where dequantize + bf16 matmul overtakes the int8 kernel
    int8_mm_width_multiple = 16

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__(weight, bias)
        self.act_dtype = weight.dtype
        self.qweight, scale = quantize_int8(weight)  # [out, in] int8, [out] fp32
        self.scale = scale.to(torch.bfloat16)  # [out]; the kernel wants scales in the activation dtype
        self.weight = self.qweight  # no dense copy is kept: both paths compute from (q, scale)
        self.bias = None if bias is None else bias.to(torch.bfloat16)

    @property
    def nbytes(self) -> int:
        n = self.qweight.numel() + self.scale.numel() * self.scale.element_size()
        return n + (self.bias.numel() * self.bias.element_size() if self.bias is not None else 0)

    def dequantized(self) -> torch.Tensor:
        """The weight this kernel multiplies by: ``[out, in]`` bf16."""
        return torch.mul(self.qweight, self.scale[:, None])  # int8 * bf16 promotes to bf16: one pass

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        xb = x.to(torch.bfloat16)
        if x.shape[0] <= self.int8_mm_max_rows and self.qweight.shape[1] % self.int8_mm_width_multiple == 0:
            y = torch.ops.aten._weight_int8pack_mm(xb, self.qweight, self.scale)
            if self.bias is not None:
                y = y + self.bias
        elif onednn_packing_available(torch.bfloat16):
            y = F.linear(xb, self.dequantized(), self.bias)
        else:  # no bf16 matmul kernels on this CPU (see `UpcastLinear`): the dense product in fp32
            w = dequantize_int8(self.qweight, self.scale)  # [out, in] fp32
            y = F.linear(xb.float(), w, None if self.bias is None else self.bias.float())
        y = y.to(self.act_dtype)
        return y if residual is None else residual + y


def onednn_applies(weight: torch.Tensor, fast: bool = True) -> bool:
    """Whether a dense ``weight`` gets a `PackedLinear` (fast path, CPU, fp32/bf16, oneDNN present)."""
    return (
        fast
        and weight.device.type == "cpu"
        and weight.dtype in (torch.float32, torch.bfloat16)
        and onednn_packing_available(weight.dtype)
    )


def make_linear(
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    fast: bool = True,
    quantization: str | None = None,
    fmt: str = "packed",
) -> Linear:
    """The kernel for one layer: int8 if asked, else oneDNN in ``fmt`` where available, else plain."""
    if quantization is not None:
        if quantization != "int8":
            raise ValueError(f"unknown quantization {quantization!r}; expected one of {QUANTIZATION_MODES}")
        return Int8Linear(weight, bias)
    if onednn_applies(weight, fast):
        return PackedLinear(weight, bias, fmt=fmt)
    return CpuLinear(weight, bias) if fast else Linear(weight, bias)
