"""`ModelConfig.from_hf_dict`: which layers a sliding window covers, as transformers reads a config,
and the fields we cannot run exactly refused by name."""

from __future__ import annotations

from typing import Any

import pytest

from engine.errors import ModelLoadError
from engine.model.config import ModelConfig
from engine.model.rope_params import RopeParams

BASE: dict[str, Any] = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)


def cfg(arch: str, **fields: Any) -> ModelConfig:
    return ModelConfig.from_hf_dict({"architectures": [arch], **BASE, **fields})


def test_windows_per_family_match_transformers() -> None:
    import transformers

    cases = [
        ("MistralForCausalLM", transformers.MistralConfig, {"sliding_window": 16}),
        ("MistralForCausalLM", transformers.MistralConfig, {"sliding_window": None}),
        ("Qwen2ForCausalLM", transformers.Qwen2Config, {"use_sliding_window": True, "sliding_window": 8,
                                                         "max_window_layers": 2}),
        ("Qwen2ForCausalLM", transformers.Qwen2Config, {"use_sliding_window": False, "sliding_window": 8}),
        ("Qwen3ForCausalLM", transformers.Qwen3Config, {"use_sliding_window": True, "sliding_window": 8,
                                                         "max_window_layers": 1}),
        ("LlamaForCausalLM", transformers.LlamaConfig, {"sliding_window": 8}),
        ("Gemma2ForCausalLM", transformers.Gemma2Config, {"sliding_window": 8}),
        ("Gemma3ForCausalLM", transformers.Gemma3TextConfig, {"sliding_window": 8}),
        ("Gemma3ForCausalLM", transformers.Gemma3TextConfig, {"sliding_window": 8, "sliding_window_pattern": 3}),
    ]
    for arch, hf_cls, fields in cases:
        ours = cfg(arch, **fields)
        hf = hf_cls(**BASE, **fields)
        # transformers' Llama keeps an unknown sliding_window as an attribute and never applies it
        windowed = hf_cls is transformers.MistralConfig and hf.sliding_window
        types = getattr(hf, "layer_types", None) or (["sliding_attention" if windowed else "full_attention"] * 4)
        expect = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
        assert ours.window_layers == expect, (arch, fields)
        assert ours.sliding_window == (fields["sliding_window"] if expect else None), (arch, fields)
        assert [ours.layer_window(i) for i in range(4)] == [ours.sliding_window if i in expect else None
                                                           for i in range(4)]
    # the file's own layer_types win, as in transformers
    got = cfg("Qwen2ForCausalLM", use_sliding_window=True, sliding_window=8,
              layer_types=["sliding_attention", "full_attention"] * 2)
    assert got.window_layers == (0, 2)
    assert cfg("Qwen3ForCausalLM").qk_norm and not cfg("Qwen2ForCausalLM").qk_norm


def test_gemma_reads_its_fields_and_defaults_as_transformers_does() -> None:
    import transformers

    g2, hf2 = cfg("Gemma2ForCausalLM"), transformers.Gemma2Config(**BASE)  # the file leaves Gemma's fields out
    assert (g2.head_dim, g2.query_pre_attn_scalar, g2.attn_softcap, g2.final_softcap, g2.tie_word_embeddings) == (
        hf2.head_dim, hf2.query_pre_attn_scalar, hf2.attn_logit_softcapping, hf2.final_logit_softcapping, True)
    assert g2.attention_scale == hf2.query_pre_attn_scalar**-0.5 and g2.sliding_rope is None
    assert cfg("Gemma2ForCausalLM", final_logit_softcapping=None).final_softcap is None  # null: no cap
    assert cfg("LlamaForCausalLM", final_logit_softcapping=30.0).final_softcap is None  # Llama never caps
    assert cfg("LlamaForCausalLM").attention_scale == 16**-0.5  # head_dim 64 / 4 heads

    # Gemma 3, older files: rope_theta (global layers, scaled), rope_local_base_freq (local layers, unscaled)
    old = dict(rope_theta=5e5, rope_local_base_freq=1e3, rope_scaling={"rope_type": "linear", "factor": 8.0})
    keyed = transformers.Gemma3TextConfig(**BASE, **old).rope_parameters  # transformers 5: keyed by layer type
    for fields in (old, {"rope_parameters": keyed}):
        g3 = cfg("Gemma3ForCausalLM", sliding_window=8, **fields)
        assert g3.window_layers == (0, 1, 2, 3)  # every 6th layer is global: none of 4
        assert (g3.rope_theta, g3.rope_scaling and g3.rope_scaling.factor) == (5e5, 8.0)
        assert g3.sliding_rope == RopeParams(1e3, None) and g3.layer_rope(0) == g3.sliding_rope
    g3 = cfg("Gemma3ForCausalLM", layer_types=["sliding_attention", "full_attention"] * 2)  # defaults: 1e4 / 1e6
    assert (g3.layer_rope(0), g3.layer_rope(1)) == (RopeParams(1e4), RopeParams(1e6))
    assert g3.qk_norm and g3.final_softcap is None and g3.attn_softcap is None


@pytest.mark.parametrize(("arch", "fields", "named"), [
    ("Gemma3ForConditionalGeneration", {"model_type": "gemma3"}, "architecture"),
    ("GemmaForCausalLM", {"model_type": "gemma"}, "architecture"),
    ("Gemma2ForCausalLM", {"hidden_activation": "gelu"}, "hidden_activation"),
    ("Gemma3ForCausalLM", {"hidden_activation": "silu"}, "hidden_activation"),
    ("Gemma2ForCausalLM", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ("Gemma3ForCausalLM", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ("Gemma3ForCausalLM", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
    ("Gemma2ForCausalLM", {"attn_logit_softcapping": 0.0}, "attn_logit_softcapping"),
    ("Gemma2ForCausalLM", {"attention_bias": True}, "attention_bias"),
    ("Gemma2ForCausalLM", {"sliding_window": None}, "sliding_window"),
    ("Gemma3ForCausalLM", {"rope_parameters": {"full_attention": {"rope_type": "dynamic", "factor": 2.0},
                                               "sliding_attention": {"rope_type": "default"}}}, "rope_scaling"),
    ("LlamaForCausalLM", {"rope_parameters": {"full_attention": {"rope_type": "default"}}}, "rope_parameters"),
])
def test_a_gemma_config_we_cannot_run_exactly_is_refused_by_name(arch: str, fields: dict[str, Any], named: str) -> None:
    with pytest.raises(ModelLoadError, match=named):
        cfg(arch, **fields)


@pytest.mark.parametrize(("fields", "named"), [
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"attention_bias": True}, "attention_bias"),
    ({"layer_types": ["chunked_attention"] * 4}, "layer_types"),
    ({"layer_types": ["full_attention"] * 3}, "layer_types"),
    ({"layer_types": ["sliding_attention"] * 4}, "sliding_window"),
    ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}}, "longrope"),
    ({"rope_scaling": {"rope_type": "proportional", "factor": 2.0}}, "rope_scaling"),
    ({"rope_scaling": {"rope_type": "dynamic"}}, "factor"),
    ({"partial_rotary_factor": 0.75}, "partial_rotary_factor"),
])
def test_a_config_we_cannot_run_exactly_is_refused_by_name(fields: dict[str, Any], named: str) -> None:
    with pytest.raises(ModelLoadError, match=named):
        cfg("LlamaForCausalLM", **fields)


@pytest.mark.parametrize(("fields", "named"), [
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling type 'linear'"),  # Phi3Config's too
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_scaling type 'dynamic'"),
    ({"rope_scaling": {"type": "su", "short_factor": [1.0] * 8}}, "long_factor"),
    ({"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0]}}, "long_factor"),
    ({"partial_rotary_factor": 0.75, "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 8,
                                                      "long_factor": [2.0] * 8}}, "short_factor"),  # 6 of them
    ({"partial_rotary_factor": 0.1}, "partial_rotary_factor"),  # int(16 * 0.1) = 1: no pair to rotate
])
def test_a_phi3_rope_we_cannot_run_exactly_is_refused_by_name(fields: dict[str, Any], named: str) -> None:
    with pytest.raises(ModelLoadError, match=named):
        cfg("Phi3ForCausalLM", **fields)
