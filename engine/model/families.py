"""The model families this engine runs, each a description of its layer's shape, never code.

Owns: `Family` (what a family's decoder layer computes, how its config file is read, what its
weights are named) and `FAMILIES`, the registry the config and the weight loader read. The forward
(`engine.model.model`) reads the features a `ModelConfig` carries, never a family's name, so a family
that only recombines existing features is one entry here.

Invariants: a family's ``defaults`` are the values transformers' config class gives the fields a
file may leave out (read under the file's own values, so a file is read as transformers reads it);
every feature here is implemented exactly by the forward (what is not is refused in `engine.model.config`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal


@dataclass(frozen=True)
class WeightNames:
    """Tensor names in a checkpoint (``{i}``: the layer index). None: the family has no such tensor."""

    q: str = "model.layers.{i}.self_attn.q_proj"
    k: str = "model.layers.{i}.self_attn.k_proj"
    v: str = "model.layers.{i}.self_attn.v_proj"
    qkv: str | None = None  # fused [q; k; v] in the checkpoint (Phi-3) in place of q, k, v
    o: str = "model.layers.{i}.self_attn.o_proj"
    gate: str = "model.layers.{i}.mlp.gate_proj"
    up: str = "model.layers.{i}.mlp.up_proj"
    gate_up: str | None = None  # fused [gate; up] (Phi-3) in place of gate, up
    down: str = "model.layers.{i}.mlp.down_proj"
    input_norm: str = "model.layers.{i}.input_layernorm"  # before attention
    pre_mlp_norm: str = "model.layers.{i}.post_attention_layernorm"  # before the MLP
    attn_out_norm: str | None = None  # on the attention's output, before the residual add (Gemma)
    mlp_out_norm: str | None = None  # on the MLP's output, before the residual add (Gemma)
    q_norm: str | None = None  # per head of q, before RoPE (Qwen3, Gemma 3)
    k_norm: str | None = None
    embed: str = "model.embed_tokens"
    final_norm: str = "model.norm"
    lm_head: str = "lm_head"


_LLAMA_NAMES = WeightNames()
_QK_NORM_NAMES = WeightNames(q_norm="model.layers.{i}.self_attn.q_norm", k_norm="model.layers.{i}.self_attn.k_norm")
_GEMMA2_NAMES = WeightNames(
    pre_mlp_norm="model.layers.{i}.pre_feedforward_layernorm",
    attn_out_norm="model.layers.{i}.post_attention_layernorm",
    mlp_out_norm="model.layers.{i}.post_feedforward_layernorm",
)
_GEMMA3_NAMES = WeightNames(
    pre_mlp_norm=_GEMMA2_NAMES.pre_mlp_norm, attn_out_norm=_GEMMA2_NAMES.attn_out_norm,
    mlp_out_norm=_GEMMA2_NAMES.mlp_out_norm, q_norm=_QK_NORM_NAMES.q_norm, k_norm=_QK_NORM_NAMES.k_norm,
)

#: How a family's files say which layers are windowed when they have no ``layer_types``: none of
#: them, all (given a window), those from ``max_window_layers`` on (given ``use_sliding_window``), or
#: every layer but each ``window_pattern``-th.
WindowRule = Literal["none", "all", "from_max_window_layers", "pattern"]


@dataclass(frozen=True)
class Family:
    """One family's decoder layer, config reading and weight names.

    ``norm_offset``: RMSNorm gains are ``1 + w`` applied in fp32 before the cast back (Gemma), else
    ``w`` applied after it (Llama). ``activation``: the MLP's gate, ``down(act(gate) * up)``.
    ``embed_scale``: embeddings times ``sqrt(hidden)`` in the activation dtype. ``gemma_attention``:
    the file's ``query_pre_attn_scalar`` sets the attention scale and its soft-caps
    (``attn_logit_softcapping``, ``final_logit_softcapping``) apply. ``rope_per_layer_type``:
    ``rope_parameters`` may be keyed by layer type, and ``rope_local_base_freq`` is the sliding
    layers' base (Gemma 3). ``rope_types``: the RoPE types transformers' config class accepts (None:
    every type), after ``rope_aliases`` (older names it rewrites). ``partial_rotary``: the attention
    rotates the first ``int(head_dim * partial_rotary_factor)`` dims of each head and passes the rest
    (Phi-3's; the other families' transformers classes rotate whole heads). ``top_level_original_max``:
    the config's own ``original_max_position_embeddings`` field (with its default) overrides the RoPE
    entry's (Phi-3). ``longrope``: the family runs longrope as transformers' Phi-3 does, whose
    generation drops its cache and recomputes the whole sequence with the long factors when it first
    grows past ``original_max_position_embeddings`` (`ModelConfig.rope_recompute_position`); other
    classes would keep the short factors' keys, which no checkpoint of theirs asks for (refused).
    """

    name: str
    architectures: tuple[str, ...]
    model_types: tuple[str, ...]
    names: WeightNames = _LLAMA_NAMES
    activation: Literal["silu", "gelu_tanh"] = "silu"
    activation_field: str = "hidden_act"  # the config field transformers reads the activation from
    norm_offset: bool = False
    embed_scale: bool = False
    qkv_bias: bool = False  # q/k/v biases by default (``attention_bias`` may say otherwise)
    gemma_attention: bool = False
    rope_per_layer_type: bool = False
    rope_types: tuple[str, ...] | None = None
    rope_aliases: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    partial_rotary: bool = False
    longrope: bool = False
    top_level_original_max: bool = False
    windows: WindowRule = "none"
    window_pattern: int = 0  # "pattern": every window_pattern-th layer (1-based) is full
    window_pattern_field: str | None = None  # a config field that overrides window_pattern
    defaults: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))

    @property
    def qk_norm(self) -> bool:
        return self.names.q_norm is not None

    @property
    def sandwich_norms(self) -> bool:
        return self.names.attn_out_norm is not None


_GEMMA_DEFAULTS = dict(hidden_activation="gelu_pytorch_tanh", head_dim=256, rms_norm_eps=1e-6,
                       tie_word_embeddings=True, query_pre_attn_scalar=256, sliding_window=4096)

FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("llama", ("LlamaForCausalLM",), ("llama",)),
    Family("mistral", ("MistralForCausalLM",), ("mistral",), windows="all"),
    Family("qwen2", ("Qwen2ForCausalLM",), ("qwen2",), qkv_bias=True, windows="from_max_window_layers"),
    Family("qwen3", ("Qwen3ForCausalLM",), ("qwen3",), names=_QK_NORM_NAMES, windows="from_max_window_layers"),
    Family("phi3", ("Phi3ForCausalLM",), ("phi3",), windows="all",
           names=WeightNames(qkv="model.layers.{i}.self_attn.qkv_proj", gate_up="model.layers.{i}.mlp.gate_up_proj"),
           rope_types=("default", "longrope"), rope_aliases=MappingProxyType({"su": "longrope", "yarn": "longrope"}),
           partial_rotary=True, top_level_original_max=True, longrope=True,
           defaults=MappingProxyType({"max_position_embeddings": 4096, "original_max_position_embeddings": 4096})),
    Family("gemma2", ("Gemma2ForCausalLM",), ("gemma2",), names=_GEMMA2_NAMES, activation="gelu_tanh",
           activation_field="hidden_activation", norm_offset=True, embed_scale=True, gemma_attention=True,
           windows="pattern", window_pattern=2,
           defaults=MappingProxyType({**_GEMMA_DEFAULTS, "max_position_embeddings": 8192,
                                      "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0})),
    Family("gemma3", ("Gemma3ForCausalLM",), ("gemma3_text",), names=_GEMMA3_NAMES, activation="gelu_tanh",
           activation_field="hidden_activation", norm_offset=True, embed_scale=True, gemma_attention=True,
           rope_per_layer_type=True, windows="pattern", window_pattern=6, window_pattern_field="sliding_window_pattern",
           defaults=MappingProxyType({**_GEMMA_DEFAULTS, "max_position_embeddings": 131072, "rope_theta": 1e6,
                                      "rope_local_base_freq": 10000.0})),
)}

#: Hugging Face ``architectures`` entries we can run, mapped to our family name.
SUPPORTED_ARCHITECTURES: dict[str, str] = {a: f.name for f in FAMILIES.values() for a in f.architectures}
#: ``model_type`` values (a config without ``architectures``), mapped to our family name.
MODEL_TYPES: dict[str, str] = {t: f.name for f in FAMILIES.values() for t in f.model_types}
#: The activation value transformers' ``ACT2FN`` computes exactly as each of ours.
ACTIVATION_NAMES = {"silu": "silu", "gelu_tanh": "gelu_pytorch_tanh"}
