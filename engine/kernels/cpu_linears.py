"""The CPU backend's weight formats, swapped into a built model one class of linears at a time.

Owns: `swap_cpu_linears` (every layer's qkv, o_proj, gate_up and down, and the lm_head, rebuilt by
`engine.kernels.kernel_choice.build_linears` in the format this machine runs fastest, or int8; the
RMSNorm gains folded into the weights that read them: ``W @ (g * x) == (W * g) @ x``) and
`native_step_for` (the whole decode step as one C++ call where every piece of it is native).

Invariants: one class is rebuilt, swapped in and its plain weights dropped before the next class
is built, so load holds at most one class twice; every format computes the plain kernel's product
up to float reassociation (int8: of the same quantized weight); a `NormedLinear` is marked folded
exactly when its gain went into its kernel's weight.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.config import EngineConfig
from engine.kernels.group_int8 import GroupInt8Linear, Weight
from engine.kernels.kernel_choice import KernelChoice, build_linears
from engine.kernels.native_step import NativeDecodeStep, native_step_error
from engine.kernels.quant import Linear
from engine.model.config import ModelConfig
from engine.model.layer import LayerKernels, NormedLinear, fold_gain


def _loaded(kernel: Linear) -> Weight:
    """The weight as the loader gave it (a group-quantized one kept packed)."""
    return kernel.packed if isinstance(kernel, GroupInt8Linear) else kernel.weight


def _normed_class(name: str, normed: list[NormedLinear], config: EngineConfig) -> KernelChoice | None:
    """Rebuild the kernels behind ``normed`` with their gains folded in; marks them folded."""
    weights = [fold_gain(_loaded(n.kernel), n.gain) for n in normed]
    biases = [n.kernel.bias for n in normed]
    for n in normed:  # the plain kernels go as soon as their folded copies exist
        n.kernel = Linear(torch.empty(0, 0), None)
    kernels, choice = build_linears(name, weights, biases, quantization=config.quantization,
                                    mode=config.linear_kernels)
    del weights
    for n, k in zip(normed, kernels, strict=True):
        n.kernel, n.folded = k, True
    return choice


def _plain_class(name: str, layers: list[LayerKernels], get: Callable[[LayerKernels], Linear],
                 put: Callable[[LayerKernels, Linear], None], config: EngineConfig) -> KernelChoice | None:
    weights = [_loaded(get(lk)) for lk in layers]
    biases = [get(lk).bias for lk in layers]
    kernels, choice = build_linears(name, weights, biases, quantization=config.quantization,
                                    mode=config.linear_kernels)
    del weights
    for lk, k in zip(layers, kernels, strict=True):
        put(lk, k)
    return choice


def swap_cpu_linears(layers: list[LayerKernels], head: NormedLinear, config: EngineConfig) -> list[KernelChoice]:
    """Every class of ``layers`` and the ``head`` in the CPU formats; returns the choices made."""
    choices = [
        _normed_class("qkv", [lk.attn_in for lk in layers], config),
        _plain_class("o_proj", layers, lambda lk: lk.o_proj, lambda lk, k: setattr(lk, "o_proj", k), config),
        _normed_class("gate_up", [lk.mlp_in for lk in layers], config),
        _plain_class("down", layers, lambda lk: lk.down, lambda lk, k: setattr(lk, "down", k), config),
        _normed_class("lm_head", [head], config),
    ]
    return [c for c in choices if c is not None]


def native_step_for(cfg: ModelConfig, layers: list[LayerKernels], head: NormedLinear, dtype: torch.dtype,
                    attention_ok: str | None) -> tuple[NativeDecodeStep | None, str | None]:
    """The one-call native decode step over these kernels, or None and why not. ``attention_ok``:
    why the decode attention cannot be the native kernel (None: it can)."""
    if attention_ok is not None:
        return None, attention_ok
    if blockers := cfg.native_step_blockers():
        return None, f"the model has {', '.join(blockers)}, which the native step does not run"
    linears = [k for lk in layers for k in lk.linears()] + [head.kernel]
    if (err := native_step_error(linears, dtype)) is not None:
        return None, err
    step = NativeDecodeStep([lk.linears() for lk in layers], head.kernel, num_heads=cfg.num_heads,
                            num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, eps=cfg.rms_norm_eps, dtype=dtype)
    return step, None
