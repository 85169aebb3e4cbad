"""What a model config's RoPE asks for: the base, the scaling and the rotated width of each set of tables.

Owns: `RopeScaling` and `RopeParams`, parsed from ``rope_scaling`` / ``rope_parameters`` (transformers
< 5 and 5.x spellings) by `ropes`, per layer type where a family keys them so (Gemma 3), and which
table a forward call uses (`RopeParams.table_key`). `engine.model.rope` turns them into tables.

Length-dependent RoPE: transformers picks ``longrope``'s factors and ``dynamic`` NTK's base anew at
every forward call from that call's ``seq_len = max(position) + 1``; a generation's prompt is one
call (every prompt token rotated by the table of the prompt's length) and each decoded token at
position p its own call (the table of p + 1), and cached keys keep the rotation they got, except
that Phi-3's generation recomputes the whole sequence (long factors) at the call that first passes
``original_max_position_embeddings`` (`engine.runner` does it at that position). `table_key` names
a call's table, so the forward (each token's key from its prompt's length, or its position in
decode) and the prefix cache (the key salts its hash chain) can follow it. transformers' dynamic
module also keeps the longest length it has seen and reuses that table for shorter calls above
``max_position_embeddings`` until one below resets it; a fresh generation never shows that, and we
take each call's own length.

Invariant: a RoPE type, factor list or partial rotary factor the tables do not compute exactly is
refused with a `ModelLoadError` naming it, never approximated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from engine.errors import ModelLoadError
from engine.model.families import Family

LAYER_TYPES = ("full_attention", "sliding_attention")  # transformers' ``layer_types`` entries we run


@dataclass(frozen=True)
class RopeScaling:
    """RoPE scaling as transformers computes it (`engine.model.rope`): ``llama3`` (frequency-dependent),
    ``linear`` (positions divided by ``factor``), ``yarn`` (an interpolation / extrapolation ramp
    between ``beta_fast`` and ``beta_slow`` rotations), ``longrope`` (per-frequency ``short_factor``
    up to ``original_max_position_embeddings`` tokens, ``long_factor`` beyond) or ``dynamic`` (NTK: the
    base grows with the length beyond ``max_position_embeddings``). yarn's and longrope's cos and sin
    are multiplied by ``attention_factor``."""

    rope_type: str
    factor: float
    original_max_position_embeddings: int = 0  # llama3, yarn, longrope
    low_freq_factor: float = 0.0  # llama3
    high_freq_factor: float = 0.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float = 1.0  # yarn, longrope: multiplies cos and sin
    truncate: bool = True  # yarn: the correction range rounded outwards to whole dimensions
    short_factor: tuple[float, ...] = ()  # longrope: one divisor per frequency
    long_factor: tuple[float, ...] = ()  # longrope
    max_position_embeddings: int = 0  # dynamic: the length beyond which the base grows

    def table_key(self, seq_len: int) -> int:
        """The table a forward call of ``seq_len`` tokens uses: 0 (the one every call uses below the
        threshold), 1 (longrope's long factors) or ``seq_len`` itself (dynamic NTK's base for it)."""
        if self.rope_type == "longrope":
            return int(seq_len > self.original_max_position_embeddings)
        if self.rope_type == "dynamic":
            return seq_len if seq_len > self.max_position_embeddings else 0
        return 0


ROPE_TYPES = ("default", "llama3", "linear", "yarn", "longrope", "dynamic")
LENGTH_DEPENDENT = ("longrope", "dynamic")  # a call's table depends on its length


@dataclass(frozen=True)
class RopeParams:
    """One set of RoPE tables' parameters: the base, the scaling (None: plain RoPE) and the share of
    each head that is rotated (transformers: the first ``int(head_dim * partial_rotary_factor)`` dims)."""

    theta: float
    scaling: RopeScaling | None = None
    partial_rotary_factor: float = 1.0

    @property
    def length_dependent(self) -> bool:
        return self.scaling is not None and self.scaling.rope_type in LENGTH_DEPENDENT

    def table_key(self, seq_len: int) -> int:
        """The table a forward call of ``seq_len`` tokens uses (0 for every call of a fixed RoPE)."""
        return 0 if self.scaling is None else self.scaling.table_key(seq_len)

    def rotary_dim(self, head_dim: int) -> int:
        """transformers' ``dim``: the frequencies are ``arange(0, dim, 2) / dim`` (``ceil(dim / 2)`` of them)."""
        return int(head_dim * self.partial_rotary_factor)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _factors(rs: dict[str, Any], name: str, n: int, source: str) -> tuple[float, ...]:
    values = rs.get(name)
    if not isinstance(values, list) or len(values) != n or not all(isinstance(x, int | float) for x in values):
        raise ModelLoadError(f"{source}: rope_scaling {name} must be a list of {n} numbers (one per rotary "
                             f"frequency), got {values!r}")
    return tuple(float(x) for x in values)


def _longrope(rs: dict[str, Any], original: int, max_positions: int, dim: int, source: str) -> RopeScaling:
    """transformers' ``_compute_longrope_parameters``: ``factor`` defaults to the ratio of the two
    lengths, ``attention_factor`` to ``sqrt(1 + ln(factor) / ln(original))`` (1 where factor <= 1)."""
    factor = float(rs["factor"]) if rs.get("factor") is not None else max_positions / original
    attention = rs.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    n = (dim + 1) // 2
    return RopeScaling("longrope", factor, original, attention_factor=float(attention),
                       short_factor=_factors(rs, "short_factor", n, source),
                       long_factor=_factors(rs, "long_factor", n, source))


def _rope_scaling(rs: dict[str, Any], cfg: dict[str, Any], family: Family, max_positions: int, dim: int,
                  source: str) -> RopeScaling | None:
    """The scaling a config's ``rope_scaling`` / ``rope_parameters`` asks for (None: plain RoPE)."""
    rope_type = rs.get("rope_type", rs.get("type")) or "default"
    rope_type = family.rope_aliases.get(rope_type, rope_type)
    allowed = family.rope_types or tuple(t for t in ROPE_TYPES if t != "longrope" or family.longrope)
    if rope_type not in allowed or rope_type not in ROPE_TYPES:
        raise ModelLoadError(f"{source}: unsupported rope_scaling type {rope_type!r} for {family.name}; "
                             f"supported: {tuple(t for t in allowed if t in ROPE_TYPES)}")
    if rope_type == "default":
        return None
    if rope_type == "linear":
        return RopeScaling("linear", float(rs["factor"]))
    if rope_type == "dynamic":
        return RopeScaling("dynamic", float(rs["factor"]), max_position_embeddings=max_positions)
    # transformers' standardize_rope_params: the entry's own value, else max_position_embeddings, but
    # a family whose config class declares the field (Phi-3) takes that field (and its default).
    original = int(cfg["original_max_position_embeddings"] if family.top_level_original_max
                   else rs.get("original_max_position_embeddings") or max_positions)
    if rope_type == "longrope":
        return _longrope(rs, original, max_positions, dim, source)
    if rope_type == "llama3":
        return RopeScaling("llama3", float(rs["factor"]), original,
                           low_freq_factor=float(rs["low_freq_factor"]), high_freq_factor=float(rs["high_freq_factor"]))
    factor = float(rs["factor"]) if rs.get("factor") is not None else max_positions / original
    attention = rs.get("attention_factor")
    if attention is None:
        mscale, all_dim = rs.get("mscale"), rs.get("mscale_all_dim")
        attention = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, all_dim) if mscale and all_dim
                     else _yarn_mscale(factor))
    return RopeScaling("yarn", factor, original, beta_fast=float(rs.get("beta_fast") or 32),
                       beta_slow=float(rs.get("beta_slow") or 1), attention_factor=float(attention),
                       truncate=bool(rs.get("truncate", True)))


def ropes(cfg: dict[str, Any], family: Family, max_positions: int, head_dim: int,
          source: str) -> tuple[RopeParams, RopeParams]:
    """The RoPE of the full-attention layers and of the sliding-window ones, as transformers reads
    them: one set for every layer, except that Gemma 3's sliding layers take ``rope_local_base_freq``
    unscaled, or their own entry where ``rope_parameters`` is keyed by layer type."""
    rp = cfg.get("rope_parameters")
    keyed = isinstance(rp, dict) and bool(rp) and set(rp) <= set(LAYER_TYPES)
    if keyed and not family.rope_per_layer_type:
        raise ModelLoadError(f"{source}: rope_parameters keyed by layer type is not supported for {family.name}")
    theta = cfg.get("rope_theta", 10000.0)

    def _rope(params: dict[str, Any], theta: Any) -> RopeParams:
        partial = float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
        if partial != 1.0 and not family.partial_rotary:
            raise ModelLoadError(f"{source}: partial_rotary_factor={partial} is not supported for {family.name} "
                                 "(transformers' class rotates whole heads)")
        if not 0.0 < partial <= 1.0 or int(head_dim * partial) < 2:
            raise ModelLoadError(f"{source}: partial_rotary_factor={partial} leaves no rotary dims of {head_dim}")
        out = RopeParams(float(params.get("rope_theta", theta)),
                         _rope_scaling(params, cfg, family, max_positions, int(head_dim * partial), source), partial)
        if out.length_dependent and family.rope_per_layer_type:
            raise ModelLoadError(f"{source}: rope_scaling type {out.scaling and out.scaling.rope_type!r} is not "
                                 f"supported for {family.name} (RoPE per layer type)")
        return out

    if keyed:
        assert isinstance(rp, dict)
        full = _rope(rp.get("full_attention") or {}, theta)
        return full, _rope(rp.get("sliding_attention") or {}, cfg.get("rope_local_base_freq"))
    # transformers < 5 writes `rope_scaling` + `rope_theta`; 5.x writes `rope_parameters`.
    full = _rope(cfg.get("rope_scaling") or rp or {}, theta)
    if not family.rope_per_layer_type:
        return full, full
    return full, RopeParams(float(cfg["rope_local_base_freq"]))
