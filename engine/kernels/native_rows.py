"""The prologues of the wrapped linear kernels (RMSNorm without gain, silu(gate) * up) as one C++
call each, compiled for this machine on first use.

Owns: loading ``engine/kernels/csrc/rows.cpp`` (built by `engine.kernels.native_build`), and `rms_norm` and `glu`,
which `engine.kernels.quant.Linear.normed` / `.glu` run before every kernel that is not the C++ matrix-vector
one (prefill chunks; decode batches beyond `engine.kernels.native_linear.NativeLinear.max_rows`).

Why: in bf16, ``F.rms_norm`` on a CPU is ten dispatched ops (upcast, pow, mean, add, rsqrt, mul,
downcast...) and silu then mul two more, each with its own pass over the rows and its own
rounding; the kernel does each in one pass, in fp32, rounded once.

Invariants: equals torch's ``F.rms_norm(x, (K,), None, eps)`` and ``F.silu(gate) * up`` up to fp32
rounding (one rounding to the activation dtype; torch's bf16 GLU rounds twice); inputs the kernel
cannot take (not a 2-D CPU fp32/bf16 tensor, or no compiler here) go to those torch ops instead, so
the result never depends on whether the library built; the result is a new contiguous tensor.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine.kernels.native_build import CSRC, build_with_or_none

SOURCE = CSRC / "rows.cpp"
_P, _I = ctypes.c_void_p, ctypes.c_int64
_ARGTYPES = [_P, _P, _I, _I, ctypes.c_int, ctypes.c_float, ctypes.c_int]
_NAMES = {torch.float32: "rows_pre_f32", torch.bfloat16: "rows_pre_bf16"}
PRE_RMS, PRE_GLU = 1, 2


@functools.cache
def load() -> ctypes.CDLL | None:
    """The built library, or None where it cannot be built here (the torch ops run instead)."""
    return build_with_or_none(SOURCE, list(_NAMES.values()), _ARGTYPES)


def _native(x: torch.Tensor) -> Callable[..., object] | None:
    if x.dtype not in _NAMES or x.device.type != "cpu" or x.dim() != 2:
        return None
    lib = load()
    return None if lib is None else getattr(lib, _NAMES[x.dtype])


def _run(fn: Callable[..., object], x: torch.Tensor, k: int, pre: int, eps: float) -> torch.Tensor:
    x = x.contiguous()
    y = torch.empty(x.shape[0], k, dtype=x.dtype)  # [T, K]
    fn(x.data_ptr(), y.data_ptr(), x.shape[0], k, pre, eps, torch.get_num_threads())
    return y


def rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, K] → x / sqrt(mean(x^2) + eps) per row (no gain), in x's dtype."""
    fn = _native(x)
    if fn is None:
        return F.rms_norm(x, (x.shape[-1],), None, eps)
    return _run(fn, x, x.shape[1], PRE_RMS, eps)


def glu(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2K] → silu(gate) * up [T, K], in gate_up's dtype."""
    fn = _native(gate_up)
    if fn is None or gate_up.shape[1] % 2:
        gate, up = gate_up.chunk(2, dim=-1)  # [T, K] each
        return F.silu(gate) * up
    return _run(fn, gate_up, gate_up.shape[1] // 2, PRE_GLU, 0.0)
