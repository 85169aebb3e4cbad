"""Tiny random Hugging Face models saved to disk: the engine tests' oracles and the serving tests' models.

Owns: `make_tiny` (a 2-layer random ``llama`` or ``qwen2``, 256-id vocabulary, fp32 safetensors: what
the engine's outputs are compared against), `make_tiny_chat_model` (the same Llama with SmolLM2's
vocabulary next to copies of the bundled model's tokenizer files, so the chat template, EOS ids and
detokenizer are the real ones) and `bundled_tokenizer_dir`.

Why the chat model: tests whose point is the serving machinery (kills, disconnects, backpressure,
multi-node, soak) need real replicas with a real tokenizer, but not SmolLM2's 30 layers; this one
loads at once and decodes a token in about a millisecond. Its output is random text (use
``ignore_eos`` where token counts matter).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from engine.loading.bundled import DEFAULT_MODEL, prepare_model

CHAT_VOCAB_SIZE = 49152  # SmolLM2's
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def make_tiny(family: str, path: Path, seed: int = 0, **overrides: object) -> Path:
    """Build a tiny random ``llama``, ``mistral``, ``qwen2``, ``qwen3``, ``phi3``, ``gemma2`` or ``gemma3``
    model with transformers and save it to ``path``; the newer families' norm gains are random too, so a
    misplaced norm shows."""
    import transformers

    torch.manual_seed(seed)
    common: dict[str, object] = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    common.update(overrides)
    if family == "llama":
        cfg = transformers.LlamaConfig(**common)
        model = transformers.LlamaForCausalLM(cfg)
    elif family == "qwen2":
        cfg = transformers.Qwen2Config(**common)
        model = transformers.Qwen2ForCausalLM(cfg)
        # Random init leaves biases at zero; make them matter.
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    elif family == "mistral":
        cfg = transformers.MistralConfig(**common)
        model = transformers.MistralForCausalLM(cfg)
    elif family == "phi3":
        cfg = transformers.Phi3Config(**{"pad_token_id": 0, **common})
        model = transformers.Phi3ForCausalLM(cfg)
    elif family == "qwen3":
        cfg = transformers.Qwen3Config(**{"head_dim": 32, **common})  # head_dim != hidden / heads, as Qwen3's
        model = transformers.Qwen3ForCausalLM(cfg)
    elif family in ("gemma2", "gemma3"):
        # head_dim != hidden / heads and query_pre_attn_scalar != head_dim, as in Gemma's own configs; local
        # and global layers alternate, the window shorter than the tests' prompts; weights large enough
        # (initializer_range) that the soft-caps change the scores and logits
        gemma: dict[str, object] = {**common, "head_dim": 32, "query_pre_attn_scalar": 24, "pad_token_id": 0,
                                    "sliding_window": 16, "num_hidden_layers": 4, "initializer_range": 0.2,
                                    "layer_types": ["sliding_attention", "full_attention"] * 2}
        if family == "gemma2":
            cfg = transformers.Gemma2Config(**{**gemma, "attn_logit_softcapping": 5.0,
                                               "final_logit_softcapping": 3.0, **overrides})
            model = transformers.Gemma2ForCausalLM(cfg)
        else:
            cfg = transformers.Gemma3TextConfig(**{**gemma, "rope_theta": 100000.0, "rope_local_base_freq": 10000.0,
                                                   **overrides})
            model = transformers.Gemma3ForCausalLM(cfg)
    else:
        raise ValueError(family)
    if family in ("mistral", "qwen3", "phi3", "gemma2", "gemma3"):
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.normal_(0.0 if family.startswith("gemma") else 1.0, 0.3)  # Gemma's gains are 1 + w
    model = model.float().eval()
    model.save_pretrained(path, safe_serialization=True)
    return path


def bundled_tokenizer_dir() -> Path:
    """The prepared bundled model folder (converted once, cached in ``~/.cache/pdserve/models``)."""
    return prepare_model(DEFAULT_MODEL, progress=False)


def make_tiny_chat_model(path: Path, *, seed: int = 0, max_position_embeddings: int = 4096,
                         hidden_size: int = 64, num_layers: int = 2) -> Path:
    """Save a tiny random Llama with SmolLM2's tokenizer to ``path`` (created) and return it."""
    path.mkdir(parents=True, exist_ok=True)
    make_tiny("llama", path, seed=seed, vocab_size=CHAT_VOCAB_SIZE, hidden_size=hidden_size,
              intermediate_size=2 * hidden_size, num_hidden_layers=num_layers, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=max_position_embeddings,
              tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    source = bundled_tokenizer_dir()
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, path / name)
    return path
