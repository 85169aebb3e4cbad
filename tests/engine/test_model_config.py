"""`ModelConfig.from_hf_dict`: which layers a sliding window covers, as transformers reads a config,
and the fields we cannot run exactly refused by name."""

from __future__ import annotations

from typing import Any

import pytest

from engine.config import ModelConfig
from engine.errors import ModelLoadError

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


@pytest.mark.parametrize(("fields", "named"), [
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"attention_bias": True}, "attention_bias"),
    ({"layer_types": ["chunked_attention"] * 4}, "layer_types"),
    ({"layer_types": ["full_attention"] * 3}, "layer_types"),
    ({"layer_types": ["sliding_attention"] * 4}, "sliding_window"),
    ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "rope_scaling"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_scaling"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "original_max_position_embeddings"),
    ({"partial_rotary_factor": 0.75}, "partial_rotary_factor"),
])
def test_a_config_we_cannot_run_exactly_is_refused_by_name(fields: dict[str, Any], named: str) -> None:
    with pytest.raises(ModelLoadError, match=named):
        cfg("LlamaForCausalLM", **fields)
