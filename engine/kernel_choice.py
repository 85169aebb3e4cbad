"""Which weight format each class of linear layers gets on this machine, measured at load.

Owns: building the kernels of one *class* of linear layers (every layer's qkv, or every layer's
down projection, or the lm_head: same shape, same dtype) and, with ``linear_kernels="auto"``,
choosing between `PackedLinear`'s two formats by timing both over the class's own weights at
decode row counts. Why measure: the fastest one-row kernel differs between CPUs (BLAS gemv on
plain weights on one Xeon, prepacked oneDNN on one EPYC, see `engine.quant`), and decode at small
batches is where a step's time is the weight read.

How: every weight of the class is run once per pass (so the pass streams the class's bytes from
memory as a decode step does, rather than re-reading one hot matrix from cache), passes of the two
formats interleaved, best of ``repeats``; ``"plain"`` wins when the geometric mean of its time
ratios to ``"packed"`` over the row counts is below ``1 - margin``, so ties keep ``"packed"``.

Invariants: both formats compute the same ``F.linear`` up to float reassociation, so the choice
never changes what the model computes beyond that; ``"packed"``/``"plain"`` pin it (no timing);
int8 and the reference path (``fast=False``) are never timed; the format not chosen is freed
before the next class is built, so load needs at most one class's weights twice.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from engine.quant import Linear, PackedLinear, make_linear, onednn_applies

LINEAR_KERNELS = ("auto", "packed", "plain")


@dataclass(frozen=True)
class KernelChoice:
    """The format one class of linears got, and the timings behind it (empty when pinned)."""

    name: str  # "qkv", "o_proj", "gate_up", "down", "lm_head"
    out_features: int
    in_features: int
    count: int  # layers in the class
    format: str  # "packed" | "plain"
    ms_per_pass: dict[str, dict[int, float]] = field(default_factory=dict)  # format → rows → ms

    def summary(self) -> str:
        times = ", ".join(
            f"{fmt} " + "/".join(f"{ms:.2f}" for ms in by_rows.values()) for fmt, by_rows in self.ms_per_pass.items()
        )
        return f"{self.name} [{self.out_features}x{self.in_features}]x{self.count}: {self.format}" + (
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


def time_formats(
    weights: Sequence[torch.Tensor],
    biases: Sequence[torch.Tensor | None],
    rows: Sequence[int] = (1, 8),
    repeats: int = 3,
) -> tuple[dict[str, list[Linear]], dict[str, dict[int, float]]]:
    """Builds the class in both formats and times a pass over it at each row count (best of ``repeats``)."""
    built: dict[str, list[Linear]] = {
        fmt: [PackedLinear(w, b, fmt=fmt) for w, b in zip(weights, biases, strict=True)]
        for fmt in PackedLinear.FORMATS
    }
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


def build_linears(
    name: str,
    weights: Sequence[torch.Tensor],
    biases: Sequence[torch.Tensor | None],
    *,
    fast: bool = True,
    quantization: str | None = None,
    mode: str = "auto",
    margin: float = 0.03,
) -> tuple[list[Linear], KernelChoice | None]:
    """The kernels of one class (one per weight, in order) and the format choice (None: not oneDNN)."""
    if mode not in LINEAR_KERNELS:
        raise ValueError(f"unknown linear_kernels {mode!r}; expected one of {LINEAR_KERNELS}")
    w0 = weights[0]
    if quantization is not None or not onednn_applies(w0, fast):
        pairs = zip(weights, biases, strict=True)
        return [make_linear(w, b, fast=fast, quantization=quantization) for w, b in pairs], None
    out_f, in_f = w0.shape
    if mode != "auto":
        kernels = [make_linear(w, b, fmt=mode) for w, b in zip(weights, biases, strict=True)]
        return kernels, KernelChoice(name, out_f, in_f, len(weights), mode)
    built, ms = time_formats(weights, biases)
    ratios = [ms["plain"][r] / ms["packed"][r] for r in ms["plain"]]
    geo_mean = math.prod(ratios) ** (1.0 / len(ratios))  # every row count weighs alike
    fmt = "plain" if geo_mean < 1.0 - margin else "packed"
    return built[fmt], KernelChoice(name, out_f, in_f, len(weights), fmt, ms)
