"""What a model config's RoPE asks for: the base and scaling of each set of tables.

Owns: `RopeScaling` and `RopeParams`, parsed from ``rope_scaling`` / ``rope_parameters`` (transformers
< 5 and 5.x spellings) by `ropes`, per layer type where a family keys them so (Gemma 3). `engine.rope`
turns them into tables. Invariant: a RoPE type or a partial rotary factor the tables do not compute
exactly is refused with a `ModelLoadError` naming it, never approximated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from engine.errors import ModelLoadError
from engine.families import Family

LAYER_TYPES = ("full_attention", "sliding_attention")  # transformers' ``layer_types`` entries we run


@dataclass(frozen=True)
class RopeScaling:
    """RoPE scaling as transformers computes it (`engine.rope`): ``llama3`` (frequency-dependent),
    ``linear`` (positions divided by ``factor``) or ``yarn`` (an interpolation / extrapolation ramp
    between ``beta_fast`` and ``beta_slow`` rotations, cos and sin times ``attention_factor``)."""

    rope_type: str
    factor: float
    original_max_position_embeddings: int = 0  # llama3, yarn
    low_freq_factor: float = 0.0  # llama3
    high_freq_factor: float = 0.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float = 1.0  # yarn: multiplies cos and sin
    truncate: bool = True  # yarn: the correction range rounded outwards to whole dimensions


ROPE_TYPES = ("default", "llama3", "linear", "yarn")


@dataclass(frozen=True)
class RopeParams:
    """One set of RoPE tables' parameters: the base and the scaling (None: plain RoPE)."""

    theta: float
    scaling: RopeScaling | None = None


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _rope_scaling(rs: dict[str, Any], max_positions: int, source: str) -> RopeScaling | None:
    """The scaling a config's ``rope_scaling`` / ``rope_parameters`` asks for (None: plain RoPE)."""
    rope_type = rs.get("rope_type", rs.get("type")) or "default"
    if rope_type not in ROPE_TYPES:
        raise ModelLoadError(f"{source}: unsupported rope_scaling type {rope_type!r}; supported: {ROPE_TYPES}")
    if rope_type == "default":
        return None
    if rope_type == "linear":
        return RopeScaling("linear", float(rs["factor"]))
    if rope_type == "llama3":
        return RopeScaling("llama3", float(rs["factor"]), int(rs["original_max_position_embeddings"]),
                           low_freq_factor=float(rs["low_freq_factor"]), high_freq_factor=float(rs["high_freq_factor"]))
    original = int(rs["original_max_position_embeddings"])
    factor = float(rs["factor"]) if rs.get("factor") is not None else max_positions / original
    attention = rs.get("attention_factor")
    if attention is None:
        mscale, all_dim = rs.get("mscale"), rs.get("mscale_all_dim")
        attention = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, all_dim) if mscale and all_dim
                     else _yarn_mscale(factor))
    return RopeScaling("yarn", factor, original, beta_fast=float(rs.get("beta_fast") or 32),
                       beta_slow=float(rs.get("beta_slow") or 1), attention_factor=float(attention),
                       truncate=bool(rs.get("truncate", True)))


def ropes(cfg: dict[str, Any], family: Family, max_positions: int, source: str) -> tuple[RopeParams, RopeParams]:
    """The RoPE of the full-attention layers and of the sliding-window ones, as transformers reads
    them: one set for every layer, except that Gemma 3's sliding layers take ``rope_local_base_freq``
    unscaled, or their own entry where ``rope_parameters`` is keyed by layer type."""
    rp = cfg.get("rope_parameters")
    keyed = isinstance(rp, dict) and bool(rp) and set(rp) <= set(LAYER_TYPES)
    if keyed and not family.rope_per_layer_type:
        raise ModelLoadError(f"{source}: rope_parameters keyed by layer type is not supported for {family.name}")
    theta = cfg.get("rope_theta", 10000.0)

    def _rope(params: dict[str, Any], theta: Any) -> RopeParams:
        if float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))) != 1.0:
            raise ModelLoadError(f"{source}: partial_rotary_factor != 1 is not supported (RoPE over whole heads)")
        return RopeParams(float(params.get("rope_theta", theta)), _rope_scaling(params, max_positions, source))

    if keyed:
        assert isinstance(rp, dict)
        full = _rope(rp.get("full_attention") or {}, theta)
        return full, _rope(rp.get("sliding_attention") or {}, cfg.get("rope_local_base_freq"))
    # transformers < 5 writes `rope_scaling` + `rope_theta`; 5.x writes `rope_parameters`.
    full = _rope(cfg.get("rope_scaling") or rp or {}, theta)
    if not family.rope_per_layer_type:
        return full, full
    return full, RopeParams(float(cfg["rope_local_base_freq"]))
