"""Decode-step linear layers as a C++ matrix-vector kernel, compiled for this machine on first use.

Owns: loading ``engine/kernels/csrc/small_linear.cpp`` (built by `engine.kernels.native_build`), `native_linear_error`,
and `NativeLinear`, a kernel with `engine.kernels.quant.Linear`'s interface that runs up to ``max_rows``
rows (decode batches) through the C++ kernel and more rows (prefill) through the kernel it wraps,
over the same plain weight (fp32, bf16, the int8 weight + scales of an `Int8Linear`, or the int8
weight + group scales of a `GroupInt8Linear`, whose RMSNorm gain it applies to the normed rows:
``csrc/small_linear_group.h``).

Why: a decode step at small batches is the weight read, and the eager ops around each matrix-vector
product cost a dispatcher call each; torch's kernels do not reach the memory bandwidth there on every
CPU, and oneDNN cannot prepack bf16 on CPUs without bf16 arithmetic. The kernel also fuses what sits
next to the product: the RMSNorm before qkv, gate_up and the lm_head (`normed`: the gain is already
folded into the weight), silu(gate) * up before down (`glu`), the residual add after o_proj and
down, the bias and the int8 scale; all of it in fp32, rounded once to the activation dtype. With
int8 weights on AVX2 the products are exact integer sums (vpmaddwd) over the prologue's output
rounded to int16 per row: half the instructions of widening every weight to fp32. Beyond 4 rows the
kernel works in tiles of rows that read each weight row once for the whole tile. Figures:
results/engine.json and docs/benchmarks-notes.md.

Invariants: computes what the wrapped kernel computes (``F.linear`` of its weight, the int8 one
dequantized with the same scales) up to fp32 reassociation, the int16 rounding of x for int8
weights (|dy| <= sum |w| * max |x| / 65534) and one rounding to the activation dtype; x and
residual are 2-D CPU tensors in fp32 or bf16 (checked: the kernel trusts its pointers); the weight
is never copied (the wrapped kernel owns it); no per-call state, so threads may share one kernel;
runs on ``torch.get_num_threads()`` threads of torch's OpenMP runtime.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from engine.kernels.group_int8 import GroupInt8Linear
from engine.kernels.native_build import CSRC, build_with, unavailable_reason
from engine.kernels.quant import Int8Linear, Linear, PackedLinear

SOURCE = CSRC / "small_linear.cpp"
_P, _I = ctypes.c_void_p, ctypes.c_int64
_ARGTYPES = [_P, _P, _P, _P, _P, _P, _I, _I, _I, ctypes.c_int, ctypes.c_float, ctypes.c_int]
_GROUP_ARGTYPES = [_P, _P, _P, _I, _P, _P, _P, _P, _I, _I, _I, ctypes.c_int, ctypes.c_float, ctypes.c_int]
_NAMES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.int8: "i8"}
_ACTS = (torch.float32, torch.bfloat16)
PRE_NONE, PRE_RMS, PRE_GLU = 0, 1, 2


@functools.cache
def load() -> ctypes.CDLL:
    """The built library (compiled on the first call in any process, then reused)."""
    names = [f"small_linear_{_NAMES[x]}_{w}" for x in _ACTS for w in _NAMES.values()]
    lib = build_with(SOURCE, names, _ARGTYPES)
    for x in _ACTS:
        fn = getattr(lib, f"small_linear_group_{_NAMES[x]}")
        fn.argtypes, fn.restype = _GROUP_ARGTYPES, None
    return lib


def native_linear_error() -> str | None:
    """None if the kernel builds and loads here, else why not."""
    return unavailable_reason(load)


def native_applies(kernel: Linear) -> bool:
    """Whether `NativeLinear` can wrap ``kernel``: a CPU int8 kernel, or a dense fp32/bf16 one whose
    ``weight`` is the plain ``[out, in]`` tensor (not oneDNN's packed layout)."""
    if isinstance(kernel, PackedLinear) and kernel.format == "packed":
        return False
    if isinstance(kernel, GroupInt8Linear) and kernel.packed.group % 16:
        return False
    w = kernel.qweight if isinstance(kernel, Int8Linear) else kernel.weight
    return (w.device.type == "cpu" and w.dtype in _NAMES and w.dim() == 2 and w.is_contiguous()
            and tuple(w.shape) == (kernel.out_features, kernel.in_features))


class NativeLinear(Linear):
    """Up to ``max_rows`` rows through the C++ kernel, more through ``base`` (same weight, same results
    up to reassociation). Build with `native_applies` true and `native_linear_error` None."""

    MAX_ROWS = 64  # most rows the C++ kernel's tiles take; `engine.kernels.kernel_choice` prices where it stops paying

    def __init__(self, base: Linear, max_rows: int = MAX_ROWS, plain: torch.Tensor | None = None) -> None:
        """``plain``: the ``[out, in]`` weight itself where ``base`` holds it in oneDNN's packed layout;
        both layouts are then kept (the class's bytes twice; `engine.kernels.kernel_choice` picks that only
        where it wins, with few rows natively and batches through oneDNN's packed kernel)."""
        self._plain_copy = plain is not None
        if plain is not None:
            if not (isinstance(base, PackedLinear) and base.format == "packed"):
                raise ValueError("a plain weight is given only beside a packed oneDNN kernel")
            if tuple(plain.shape) != (base.out_features, base.in_features) or not plain.is_contiguous():
                raise ValueError(f"plain weight must be a contiguous [{base.out_features}, {base.in_features}]")
        elif not native_applies(base):
            raise ValueError(f"native linear needs a plain CPU fp32/bf16/int8 weight, not {type(base).__name__}")
        if not 1 <= max_rows <= self.MAX_ROWS:
            raise ValueError(f"max_rows must lie in [1, {self.MAX_ROWS}], got {max_rows}")
        lib = load()
        # More rows (prefill chunks; on CPUs whose oneDNN has AMX, decode batches beyond a few rows,
        # as `engine.kernels.kernel_choice` measures) go to the wrapped kernel.
        self.max_rows = max_rows
        self.base = base
        self.weight, self.bias = base.weight, base.bias  # for callers that read them; never copied
        self.out_features, self.in_features = base.out_features, base.in_features
        w = plain if plain is not None else base.qweight if isinstance(base, Int8Linear) else base.weight  # [out, in]
        self._w = w
        # fp32 copies of the small per-channel vectors the kernel reads (bf16 scale: the values base uses).
        self._scale = base.scale.float().contiguous() if isinstance(base, Int8Linear) else None  # [out]
        self._bias = base.bias.float().contiguous() if base.bias is not None else None  # [out]
        self._fns = {x: getattr(lib, f"small_linear_{_NAMES[x]}_{_NAMES[w.dtype]}") for x in _ACTS}
        # int8 with a scale per group of inputs (`engine.kernels.group_int8`): its own entry point, the gain on pre(x)
        self.group, self._gain = 0, None
        if isinstance(base, GroupInt8Linear):
            self.group, self._scale = base.packed.group, base.packed.scale.float().contiguous()  # [out, in / group]
            self._gain = None if base.gain is None else base.gain.float().contiguous()  # [in]
            self._fns = {x: getattr(lib, f"small_linear_group_{_NAMES[x]}") for x in _ACTS}

    @property
    def nbytes(self) -> int:
        """Bytes one call streams (one layout of the weight, whichever kernel runs)."""
        return self.base.nbytes

    @property
    def extra_nbytes(self) -> int:
        """Memory held beyond `nbytes`: the plain weight kept beside a packed one (else 0)."""
        return self._w.numel() * self._w.element_size() if self._plain_copy else 0

    def operands(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """What the kernel reads: the weight [out, in] (fp32, bf16 or int8) and the fp32 scale and bias
        [out] (None where absent), for callers that run it from C++ (`engine.kernels.native_step`)."""
        return self._w, self._scale, self._bias

    def grouping(self) -> tuple[int, torch.Tensor | None]:
        """For int8 weights with group scales: the inputs per scale and the fp32 gain [in] the RMSNorm
        prologue applies (or None); (0, None) for every other weight."""
        return self.group, self._gain

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x: [T, in] → [T, out] (+ residual [T, out])."""
        if x.shape[0] > self.max_rows:
            return self.base(x, residual)
        return self._run(x, residual, PRE_NONE, 0.0)

    def normed(self, x: torch.Tensor, eps: float) -> torch.Tensor:
        if x.shape[0] > self.max_rows:
            return self.base.normed(x, eps)
        return self._run(x, None, PRE_RMS, eps)

    def glu(self, gate_up: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if gate_up.shape[0] > self.max_rows:
            return self.base.glu(gate_up, residual)
        return self._run(gate_up, residual, PRE_GLU, 0.0)

    def _run(self, x: torch.Tensor, residual: torch.Tensor | None, pre: int, eps: float) -> torch.Tensor:
        fn = self._fns.get(x.dtype)
        k = self.in_features * (2 if pre == PRE_GLU else 1)
        if fn is None or not x.is_cpu or x.dim() != 2 or x.shape[1] != k:
            raise ValueError(f"native linear [{self.out_features}x{self.in_features}] takes a CPU fp32/bf16 "
                             f"[T, {k}] input, got {x.dtype} {tuple(x.shape)} on {x.device}")
        m, n = x.shape[0], self.out_features
        x = x.contiguous()
        r = None
        if residual is not None:
            if tuple(residual.shape) != (m, n) or not residual.is_cpu:
                raise ValueError(f"residual must be [{m}, {n}] on the CPU, got {tuple(residual.shape)}")
            r = residual.to(x.dtype).contiguous()
        y = torch.empty(m, n, dtype=x.dtype)  # [T, out]
        scale, bias = (None if t is None else t.data_ptr() for t in (self._scale, self._bias))
        res = None if r is None else r.data_ptr()
        if self.group:
            gain = None if self._gain is None or pre != PRE_RMS else self._gain.data_ptr()
            fn(x.data_ptr(), self._w.data_ptr(), scale, self.group, gain, bias, res, y.data_ptr(), m, n,
               self.in_features, pre, eps, torch.get_num_threads())
        else:
            fn(x.data_ptr(), self._w.data_ptr(), scale, bias, res, y.data_ptr(), m, n, self.in_features, pre, eps,
               torch.get_num_threads())
        return y
