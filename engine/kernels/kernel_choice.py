"""Which kernel each class of linear layers gets on this machine, measured at load.

Owns: building the kernels of one *class* of linear layers (every layer's qkv, or every layer's
down projection, or the lm_head: same shape, same dtype) and, with ``linear_kernels="auto"``,
choosing between the formats that apply by timing them over the class's own weights at decode row
counts: dense fp32/bf16 where oneDNN can prepack the dtype, `PackedLinear`'s ``"packed"`` and
``"plain"``; dense without oneDNN packing (bf16 on CPUs without AVX-512/AVX-NE), ``"plain"``
(``F.linear``) and ``"upcast"`` (`UpcastLinear`: many rows in fp32); int8, ``"int8"``
(`Int8Linear`); and in each case ``"native"`` (`engine.kernels.native_linear`, the C++ matrix-vector
kernel for few rows around the plain, upcast or int8 kernel) where it builds. A class holding
group-quantized weights (a GGUF's Q8_0, `engine.kernels.group_int8`) is not timed: ``"native"`` over
``"int8_group"`` where the C++ kernel builds, else ``"int8_group"`` (a dense member: ``"int8"``). Why measure: the
fastest few-row kernel differs between CPUs (BLAS gemv on plain weights, oneDNN's prepacked
weights with or without AMX, or the C++ kernel, depending on the vector units), and decode at small
batches is where a step's time is the weight read.

How: every weight of the class is run once per pass (so the pass streams the class's bytes from
memory as a decode step does, rather than re-reading one hot matrix from cache), passes of the
formats interleaved, best of ``repeats``; the first format listed is the default, and another one
wins when the geometric mean of its time ratios to the default over the row counts is the least
and below ``1 - margin``, so ties keep the default. "native" also competes with a row limit
(`with_native_limits`: the C++ kernel up to r rows, the kernel it wraps beyond, priced from the same
timings), which is what wins where oneDNN has AMX: one-row decode steps natively (and then as one
native call, `engine.kernels.native_step`), batches through oneDNN. Over oneDNN's packed kernel that keeps
the plain weight too (the class's memory twice), so it must beat the best choice without a copy by
the margin as well. Whatever the choice, the C++ kernel then also takes the fewest rows up to where
it costs at most `STEP_TOLERANCE` more than the chosen kernel (`native_prefix`; over oneDNN's packed
kernel only for classes up to `STEP_COPY_MAX_BYTES`, as it needs the plain copy): when every class
does, a small decode batch runs as one C++ call that holds the GIL once, which inside a serving
replica is worth more than the per-class timing shows.

Invariants: every format computes the same ``F.linear`` (int8: of the same dequantized weight)
up to float reassociation, so the choice never changes what the model computes beyond that; a
named mode pins it (no timing; ``"native"`` where it cannot build is refused with the reason, and
int8 ignores the dense modes ``"packed"``/``"plain"``); the reference path (``fast=False``) is
never timed; the formats not chosen are freed before the next class is built, so load needs at
most one class's weights twice.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from engine.config import LINEAR_KERNELS
from engine.kernels.group_int8 import GroupInt8Linear, GroupQuantized, Weight
from engine.kernels.native_linear import NativeLinear, native_applies, native_linear_error
from engine.kernels.quant import Linear, PackedLinear, UpcastLinear, make_linear, onednn_applies

TIMED_ROWS = (1, 4, 8, 32)
WRAPPED = ("upcast", "plain", "int8")  # what "native" wraps (runs its rows beyond max_rows), first that applies
# How much slower than a class's pick its C++ kernel may be at a row count and still take it: a
# batch every class takes natively runs as one call, which a per-class timing cannot see (the
# per-layer path hands the GIL back and forth at each of its few hundred ops, a long wait each
# inside a replica whose event loop wants it too).
STEP_TOLERANCE = 0.5
# Where that needs the plain weight beside oneDNN's packed one, only for classes up to this size:
# the saving is a fixed cost per step, which matters for small models' short steps.
STEP_COPY_MAX_BYTES = 512 << 20

@dataclass(frozen=True)
class KernelChoice:
    """The format one class of linears got, and the timings behind it (empty when pinned)."""

    name: str  # "qkv", "o_proj", "gate_up", "down", "lm_head"
    out_features: int
    in_features: int
    count: int  # layers in the class
    format: str  # "packed" | "plain" | "upcast" | "int8" | "int8_group" (`engine.kernels.group_int8`) | "native"
    ms_per_pass: dict[str, dict[int, float]] = field(default_factory=dict)  # format → rows → ms
    native_max_rows: int = 0  # "native": the most rows its C++ kernel takes; more go to the kernel it wraps
    wraps: str = ""  # "native": the format of that kernel ("packed": the plain weight is kept beside it)

    def summary(self) -> str:
        times = ", ".join(
            f"{fmt} " + "/".join(f"{ms:.2f}" for ms in by_rows.values()) for fmt, by_rows in self.ms_per_pass.items()
        )
        fmt = (f"native up to {self.native_max_rows} rows, then {self.wraps}" if self.format == "native"
               else self.format)
        return f"{self.name} [{self.out_features}x{self.in_features}]x{self.count}: {fmt}" + (
            f" (ms per pass at rows {'/'.join(map(str, self.rows()))}: {times})" if times else ""
        )

    def rows(self) -> list[int]:
        return sorted({r for by_rows in self.ms_per_pass.values() for r in by_rows})


def best_of_interleaved(runs: Mapping[str, Callable[[], float]], repeats: int) -> dict[str, float]:
    """Each run once as a warm-up, then ``repeats`` rounds of all of them in turn; the least
    milliseconds (as each run reports them) of each. Interleaving makes load hit every run alike."""
    for run in runs.values():
        run()
    best = {name: float("inf") for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            best[name] = min(best[name], run())
    return best


def _pass_ms(kernels: Sequence[Linear], x: torch.Tensor) -> float:
    t0 = time.perf_counter()
    for k in kernels:
        k(x)
    return (time.perf_counter() - t0) * 1e3


Builder = Callable[[torch.Tensor, "torch.Tensor | None"], Linear]


def formats(w0: torch.Tensor, quantization: str | None) -> dict[str, Builder]:
    """The kernels that apply to a class of ``w0``'s dtype, the default first (fast path only)."""
    out: dict[str, Builder]
    if quantization is not None:
        out = {"int8": lambda w, b: make_linear(w, b, quantization=quantization)}
    elif onednn_applies(w0):
        out = {fmt: functools.partial(lambda w, b, fmt: PackedLinear(w, b, fmt=fmt), fmt=fmt)
               for fmt in PackedLinear.FORMATS}
    else:
        out = {"plain": lambda w, b: make_linear(w, b)}
        if w0.dtype == torch.bfloat16 and w0.device.type == "cpu":  # no bf16 matmul kernels here
            out["upcast"] = UpcastLinear
    if w0.device.type == "cpu" and native_linear_error() is None:
        base = out[wrapped_format(out)]  # what runs the prefill rows
        out["native"] = lambda w, b: NativeLinear(base(w, b))
    return out


def time_formats(
    weights: Sequence[torch.Tensor],
    biases: Sequence[torch.Tensor | None],
    builders: Mapping[str, Builder],
    rows: Sequence[int] = TIMED_ROWS,
    repeats: int = 3,
) -> tuple[dict[str, list[Linear]], dict[str, dict[int, float]]]:
    """Builds the class in every format and times a pass over it at each row count (best of ``repeats``)."""
    built = {fmt: [make(w, b) for w, b in zip(weights, biases, strict=True)] for fmt, make in builders.items()}
    g = torch.Generator().manual_seed(0)
    ms: dict[str, dict[int, float]] = {fmt: {} for fmt in built}
    with torch.inference_mode():
        for r in rows:
            x = torch.randn(r, weights[0].shape[1], generator=g).to(weights[0].dtype)  # [rows, in]
            # (the warm-up pass also has oneDNN build its primitive for this row count)
            runs = {fmt: functools.partial(_pass_ms, kernels, x) for fmt, kernels in built.items()}
            for fmt, t in best_of_interleaved(runs, repeats).items():
                ms[fmt][r] = t
    return built, ms


def wrapped_format(formats: Mapping[str, object]) -> str:
    """The format "native" wraps among ``formats`` (`formats` builds it over that one)."""
    return next(f for f in WRAPPED if f in formats)


def with_native_limits(ms: Mapping[str, Mapping[int, float]]) -> dict[str, dict[int, float]]:
    """``ms`` and, where "native" was timed, ``"native<=r"`` for each timed row count r but the last:
    what a `NativeLinear` with ``max_rows=r`` costs (its C++ kernel's time up to r rows, the wrapped
    kernel's beyond), and where "packed" was timed ``"native<=r+packed"``, the same over oneDNN's
    packed kernel (the plain weight kept beside the packed one). Where oneDNN has AMX the C++ kernel
    wins at one row and loses by 2-5 x at 32."""
    out = {f: dict(by_rows) for f, by_rows in ms.items()}
    if "native" in ms:  # (`formats` builds it only over a wrapped format)
        base, rows = wrapped_format(ms), sorted(ms["native"])
        for r in rows[:-1]:
            out[f"native<={r}"] = {n: ms["native" if n <= r else base][n] for n in rows}
            if "packed" in ms:  # over oneDNN's packed kernel: the plain weight kept beside it
                out[f"native<={r}+packed"] = {n: ms["native" if n <= r else "packed"][n] for n in rows}
    return out


def native_prefix(ms: Mapping[str, Mapping[int, float]], fmt: str, tolerance: float) -> int:
    """The most timed rows r such that the C++ kernel costs at most ``1 + tolerance`` times ``fmt``'s
    time at every timed row count up to r (0: not even at the fewest). Those rows then run natively,
    ``fmt`` beyond; `STEP_TOLERANCE` lets the C++ kernel be somewhat slower than ``fmt`` on its own,
    because a batch that every class takes natively runs as one call (`engine.kernels.native_step`)."""
    if "native" not in ms or fmt not in ms:
        return 0
    limit = 0
    for n in sorted(ms["native"]):
        if ms["native"][n] > ms[fmt][n] * (1.0 + tolerance):
            break
        limit = n
    return limit


def pick(ms: Mapping[str, Mapping[int, float]], margin: float) -> str:
    """The default (first) format unless another's geometric-mean time ratio to it is the least and below
    ``1 - margin``: every row count weighs alike."""
    default = next(iter(ms))
    def ratio(fmt: str) -> float:
        rs = [ms[fmt][r] / ms[default][r] for r in ms[default]]
        return math.prod(rs) ** (1.0 / len(rs))
    best = min(ms, key=ratio)
    return best if ratio(best) < 1.0 - margin else default


def _group_linears(name: str, pairs: Sequence[tuple[Weight, torch.Tensor | None]],
                   mode: str) -> tuple[list[Linear], KernelChoice]:
    """A class holding group-quantized weights: `GroupInt8Linear`s (`Int8Linear` for a dense member),
    each wrapped in the C++ kernel up to its most rows where it builds (untimed: the torch kernel
    dequantizes the whole weight on every call, which decode rows cannot win back)."""
    out_f, in_f = pairs[0][0].shape
    kernels = [GroupInt8Linear(w, b) if isinstance(w, GroupQuantized) else make_linear(w, b, quantization="int8")
               for w, b in pairs]
    cpu = all(k.weight.device.type == "cpu" for k in kernels)
    if mode == "native" and (not cpu or native_linear_error() is not None):
        why = native_linear_error() or "the weights are not on the CPU"
        raise RuntimeError(f"linear_kernels='native' cannot run here: {why}")
    if not cpu or native_linear_error() is not None or not all(native_applies(k) for k in kernels):
        return kernels, KernelChoice(name, out_f, in_f, len(pairs), "int8_group")
    return ([NativeLinear(k) for k in kernels],
            KernelChoice(name, out_f, in_f, len(pairs), "native", native_max_rows=NativeLinear.MAX_ROWS,
                         wraps="int8_group"))


def build_linears(
    name: str,
    weights: Sequence[Weight],
    biases: Sequence[torch.Tensor | None],
    *,
    fast: bool = True,
    quantization: str | None = None,
    mode: str = "auto",
    margin: float = 0.03,
) -> tuple[list[Linear], KernelChoice | None]:
    """The kernels of one class (one per weight, in order) and the format choice (None: reference path)."""
    if mode not in LINEAR_KERNELS:
        raise ValueError(f"unknown linear_kernels {mode!r}; expected one of {LINEAR_KERNELS}")
    pairs = list(zip(weights, biases, strict=True))
    out_f, in_f = weights[0].shape
    if any(isinstance(w, GroupQuantized) for w in weights):  # Q8_0 weights as the file has them
        return _group_linears(name, pairs, mode)
    dense = [w for w in weights if isinstance(w, torch.Tensor)]  # (all of them)
    dense_pairs = list(zip(dense, biases, strict=True))
    w0 = dense[0]
    if quantization is None and not fast:
        return [make_linear(w, b, fast=False) for w, b in dense_pairs], None
    builders = formats(w0, quantization)
    if mode == "native" and "native" not in builders:
        why = native_linear_error() or f"not for {w0.dtype} weights on {w0.device}"
        raise RuntimeError(f"linear_kernels='native' cannot run here: {why}")
    if mode != "auto" or len(builders) == 1:
        # pinned, or nothing to choose from; int8 / no oneDNN: the dense modes are moot, the default runs
        fmt = mode if mode in builders else next(iter(builders))
        kernels = [builders[fmt](w, b) for w, b in dense_pairs]
        if fmt == "native":
            return kernels, KernelChoice(name, out_f, in_f, len(dense), fmt, native_max_rows=NativeLinear.MAX_ROWS,
                                         wraps=wrapped_format(builders))
        return kernels, KernelChoice(name, out_f, in_f, len(dense), fmt)
    built, ms = time_formats(dense, biases, builders)
    cands = with_native_limits(ms)
    fmt = pick({f: t for f, t in cands.items() if not f.endswith("+packed")}, margin)
    if copies := {f: t for f, t in cands.items() if f.endswith("+packed")}:
        # keeping the plain weight beside the packed one doubles the class's memory: only for a clear win
        fmt = pick({fmt: cands[fmt], **copies}, margin)
    over, limit = fmt, 0  # "native": up to `limit` rows, the kernel of format `over` beyond
    if fmt == "native":
        return built[fmt], KernelChoice(name, out_f, in_f, len(dense), fmt, ms, NativeLinear.MAX_ROWS,
                                        wrapped_format(built))
    if fmt.startswith("native<="):
        over = "packed" if fmt.endswith("+packed") else wrapped_format(built)
        limit = int(fmt.removeprefix("native<=").removesuffix("+packed"))
    if over != "packed" or sum(w.numel() * w.element_size() for w in dense) <= STEP_COPY_MAX_BYTES:
        limit = max(limit, native_prefix(ms, over, STEP_TOLERANCE))
    if not limit:
        return built[fmt], KernelChoice(name, out_f, in_f, len(dense), fmt, ms)
    kernels = [NativeLinear(k, max_rows=limit, plain=w.contiguous() if over == "packed" else None)
               for k, w in zip(built[over], dense, strict=True)]
    return kernels, KernelChoice(name, out_f, in_f, len(dense), "native", ms, limit, over)
