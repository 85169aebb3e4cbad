"""A model's architecture: `ModelConfig`, read from a Hugging Face ``config.json``.

Owns: `ModelConfig` (its family of `engine.model.families`, the sizes and values its config file
sets, its RoPE from `engine.model.rope_params`, sliding windows per layer, soft-caps) and the
readers behind `ModelConfig.from_hf_dict` (`_refuse_unsupported`, `_windows`).

Invariants: a `ModelConfig` is frozen and self-consistent (``num_heads % num_kv_heads == 0``,
``head_dim * num_heads`` need not equal ``hidden_size`` but every size is positive); unknown
architectures are refused by name, never guessed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from engine.config import checkpoint_dtype
from engine.errors import ModelLoadError
from engine.model.families import ACTIVATION_NAMES, FAMILIES, MODEL_TYPES, SUPPORTED_ARCHITECTURES, Family
from engine.model.rope_params import LAYER_TYPES, RopeParams, RopeScaling, ropes


@dataclass(frozen=True)
class ModelConfig:
    """The architecture of one model: its family's layer shape (`features`, `engine.model.families`) and
    the sizes and values its config file sets.

    ``sliding_window``: the keys a query of a windowed layer sees, itself included (positions
    ``p - window + 1 .. p``, transformers' definition), in the layers ``window_layers`` names; None
    with no windowed layer. ``qk_norm``: an RMSNorm over each head of q and of k before RoPE (Qwen3,
    Gemma 3). ``query_pre_attn_scalar``: the attention scale is its inverse square root (Gemma), else
    ``head_dim``'s. ``attn_softcap`` / ``final_softcap``: attention scores / logits pass through
    ``cap * tanh(x / cap)`` (Gemma 2). ``sliding_rope``: the windowed layers' RoPE where it is not
    the other layers' (``rope_theta``, ``rope_scaling``, ``partial_rotary_factor``; Gemma 3's local base).
    """

    family: str  # a key of `engine.model.families.FAMILIES`
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2)
    rope_scaling: RopeScaling | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    sliding_window: int | None = None
    window_layers: tuple[int, ...] = ()  # indices of the layers that attend over the window only
    qk_norm: bool = False
    query_pre_attn_scalar: float | None = None
    attn_softcap: float | None = None
    final_softcap: float | None = None
    sliding_rope: RopeParams | None = None
    checkpoint_dtype: torch.dtype | None = None  # what the weights are stored in (`checkpoint_dtype`)
    partial_rotary_factor: float = 1.0  # the full-attention layers' share of each head that RoPE rotates

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model config: {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model config: num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}"
            )
        if (self.sliding_window is None) != (not self.window_layers) or (
                self.sliding_window is not None and self.sliding_window <= 0):
            raise ValueError(f"model config: sliding_window={self.sliding_window} with windowed layers "
                             f"{list(self.window_layers)}")

    def layer_window(self, layer: int) -> int | None:
        """The window layer ``layer`` attends over (None: every earlier position)."""
        return self.sliding_window if layer in self.window_layers else None

    def layer_rope(self, layer: int) -> RopeParams:
        """The RoPE parameters of layer ``layer``."""
        if self.sliding_rope is not None and layer in self.window_layers:
            return self.sliding_rope
        return RopeParams(self.rope_theta, self.rope_scaling, self.partial_rotary_factor)

    def rope_table_key(self, seq_len: int) -> int:
        """The RoPE table a forward call of ``seq_len`` tokens uses (`RopeParams.table_key`; only the
        full-attention layers' RoPE may depend on the length): a prompt's tokens' keys depend on it,
        so it salts the prefix cache's hash chain."""
        return RopeParams(self.rope_theta, self.rope_scaling).table_key(seq_len)

    @property
    def rope_recompute_position(self) -> int | None:
        """The decode position at which a sequence is recomputed whole instead of decoded (None: never):
        longrope's ``original_max_position_embeddings``, where transformers' Phi-3 generation, first
        past it, drops its cache and runs every token again with the long factors."""
        s = self.rope_scaling
        return s.original_max_position_embeddings if s is not None and s.rope_type == "longrope" else None

    @property
    def max_context(self) -> int:
        """The longest sequence this model is served for: ``max_position_embeddings``, times ``factor``
        for dynamic NTK RoPE, whose base grows past it (vLLM's limit for it)."""
        s = self.rope_scaling
        if s is not None and s.rope_type == "dynamic":
            return int(self.max_position_embeddings * s.factor)
        return self.max_position_embeddings

    @property
    def features(self) -> Family:
        """The family's layer shape: what the forward computes beyond the sizes."""
        return FAMILIES[self.family]

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar if self.query_pre_attn_scalar is not None else self.head_dim) ** -0.5

    def native_step_blockers(self) -> list[str]:
        """What this model computes that the one-call native decode step (`engine.kernels.native_step`) does not."""
        f = self.features
        named = {"q/k norms": self.qk_norm, "sliding-window layers": bool(self.window_layers),
                 "offset norms (1 + w)": f.norm_offset, "sandwich norms": f.sandwich_norms,
                 f"a {f.activation} MLP": f.activation != "silu", "an embedding scale": f.embed_scale,
                 "a query_pre_attn_scalar": self.attention_scale != self.head_dim**-0.5,
                 "logit soft-capping": self.attn_softcap is not None or self.final_softcap is not None,
                 "RoPE per layer type": self.sliding_rope is not None}
        return [name for name, present in named.items() if present]

    @cached_property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @cached_property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of K and V over all layers for one token."""
        return 2 * self.num_layers * self.kv_size * torch.finfo(dtype).bits // 8

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], source: str = "<dict>") -> ModelConfig:
        archs = cfg.get("architectures") or []
        name = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if name is None:
            model_type = cfg.get("model_type")
            if not archs and model_type in MODEL_TYPES:  # architectures name the head: model_type only without
                name = MODEL_TYPES[str(model_type)]
            else:
                raise ModelLoadError(
                    f"{source}: unsupported architecture {archs or model_type!r}; "
                    f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
                )
        family = FAMILIES[name]
        cfg = {**family.defaults, **cfg}
        try:
            num_heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            head_dim = int(cfg.get("head_dim") or hidden // num_heads)
            num_layers = int(cfg["num_hidden_layers"])
            max_positions = int(cfg.get("max_position_embeddings", 2048))
            _refuse_unsupported(cfg, family, source)
            window, window_layers = _windows(cfg, family, num_layers, source)
            full_rope, sliding_rope = ropes(cfg, family, max_positions, head_dim, source)
            eos = cfg.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            gemma = family.gemma_attention
            return cls(
                family=name,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=num_layers,
                num_heads=num_heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
                head_dim=head_dim,
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=full_rope.theta,
                max_position_embeddings=max_positions,
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=bool(cfg.get("attention_bias", family.qkv_bias)),
                rope_scaling=full_rope.scaling,
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=eos_ids,
                sliding_window=window,
                window_layers=window_layers,
                qk_norm=family.qk_norm,
                query_pre_attn_scalar=float(cfg["query_pre_attn_scalar"]) if gemma else None,
                attn_softcap=_optional_float(cfg.get("attn_logit_softcapping")) if gemma else None,
                final_softcap=_optional_float(cfg.get("final_logit_softcapping")) if gemma else None,
                sliding_rope=sliding_rope if window_layers and sliding_rope != full_rope else None,
                checkpoint_dtype=checkpoint_dtype(cfg),
                partial_rotary_factor=full_rope.partial_rotary_factor,
            )
        except KeyError as e:
            raise ModelLoadError(f"{source}: config is missing required field {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise ModelLoadError(f"{source}: invalid config: {e}") from None

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        cfg_path = Path(path) / "config.json"
        if not cfg_path.is_file():
            raise ModelLoadError(f"{cfg_path}: config.json not found")
        try:
            data = json.loads(cfg_path.read_text())
        except json.JSONDecodeError as e:
            raise ModelLoadError(f"{cfg_path}: not valid JSON: {e}") from None
        return cls.from_hf_dict(data, source=str(cfg_path))


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _refuse_unsupported(cfg: dict[str, Any], family: Family, source: str) -> None:
    """Raises `ModelLoadError` naming a field whose value this engine would not run exactly."""
    field = family.activation_field
    act = cfg.get(field, cfg.get("hidden_activation", "silu"))
    expected = ACTIVATION_NAMES[family.activation]
    if act != expected:
        raise ModelLoadError(f"{source}: {field}={act!r} is not supported for {family.name} (the MLP is "
                             f"down({expected}(gate) * up))")
    if cfg.get("mlp_bias"):
        raise ModelLoadError(f"{source}: mlp_bias=true is not supported (the MLP projections carry no bias)")
    if cfg.get("attention_bias") and not family.qkv_bias:
        raise ModelLoadError(f"{source}: attention_bias=true is not supported for {family.name} (o_proj bias)")
    if cfg.get("use_bidirectional_attention"):
        raise ModelLoadError(f"{source}: use_bidirectional_attention=true is not supported (causal attention only)")
    if family.gemma_attention and family.rope_per_layer_type and cfg.get("attn_logit_softcapping") is not None:
        raise ModelLoadError(f"{source}: attn_logit_softcapping is set, which transformers' {family.name} does not "
                             "apply; refused rather than guessed")
    for name in ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar"):
        value = cfg.get(name)
        if family.gemma_attention and value is not None and not float(value) > 0:
            raise ModelLoadError(f"{source}: {name}={value!r} must be positive")


def _windows(cfg: dict[str, Any], family: Family, num_layers: int, source: str) -> tuple[int | None, tuple[int, ...]]:
    """The sliding window and the layers that use it, as transformers reads them: ``layer_types``
    where the config has it; else by the family's rule (`engine.model.families.WindowRule`): Mistral and
    Phi-3 window every layer, Qwen2/Qwen3 (with ``use_sliding_window``) the layers from
    ``max_window_layers`` on, Gemma all but every second (Gemma 2) or ``sliding_window_pattern``-th
    (Gemma 3)."""
    window = cfg.get("sliding_window")
    if family.windows == "from_max_window_layers" and not cfg.get("use_sliding_window"):
        window = None
    if family.windows == "none":
        window = None  # transformers' Llama has no window, whatever the file says
    types = cfg.get("layer_types")
    if types is None and family.windows == "pattern":
        pattern = int(cfg.get(family.window_pattern_field or "", family.window_pattern) or family.window_pattern)
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    if types is not None:
        if len(types) != num_layers or any(t not in LAYER_TYPES for t in types):
            raise ModelLoadError(f"{source}: layer_types must list one of {LAYER_TYPES} per layer "
                                 f"({num_layers}), got {types!r}")
        layers = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
        if layers and window is None:
            raise ModelLoadError(f"{source}: layer_types has sliding_attention layers but sliding_window is unset")
    elif window is None:
        layers = ()
    elif family.windows == "all":
        layers = tuple(range(num_layers))
    else:
        layers = tuple(range(int(cfg.get("max_window_layers", num_layers)), num_layers))
    return (int(window) if layers and window is not None else None), layers
