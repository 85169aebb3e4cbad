"""The models the GPU check runs, all built on the spot (no downloads, nothing read from a hub).

Owns: `FAMILIES` (the seven families checked against transformers), `tiny_model` (their tiny random
Hugging Face folders, written by `tests.support.models.make_tiny`), `load_hf` (transformers' model
of such a folder: the oracle), `LLAMA3_8B` / `SMOKE_SHAPE` (the shape the timings run: Llama-3-8B's on
a GPU, a small one in the CPU smoke mode), `shape_config` and `random_weights` (that shape's config
folder and random weights made in memory, straight on the device: 16 GB never touch a disk).

Invariants: the same seed gives the same weights; random weights are finite and small (std 0.02,
norm gains 1), so no step of a timed forward meets an inf or NaN; only ``config.json`` is written
for the 8B shape (the engine's model folder: its tokenizer-free config).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from engine.config import EngineConfig
from engine.loading.weights import LayerWeights, ModelWeights
from engine.model.config import ModelConfig

FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "phi3", "gemma2", "gemma3")

#: Llama-3-8B's architecture (meta-llama/Meta-Llama-3-8B's config.json, sizes only)
LLAMA3_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "tie_word_embeddings": False, "bos_token_id": 128000, "eos_token_id": 128001,
    "hidden_act": "silu", "torch_dtype": "bfloat16",
}

#: the same family and proportions, small enough for the CPU smoke mode
SMOKE_SHAPE: dict[str, Any] = {**LLAMA3_8B, "vocab_size": 1024, "hidden_size": 128, "intermediate_size": 448,
                               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1,
                               "max_position_embeddings": 8192, "bos_token_id": 1, "eos_token_id": 2,
                               "torch_dtype": "float32"}


def tiny_model(family: str, root: Path) -> Path:
    """The folder of ``family``'s tiny random model (fp32 safetensors) under ``root``, written once."""
    from tests.support.models import make_tiny

    path = root / family
    if not (path / "config.json").is_file():
        make_tiny(family, path, seed=FAMILIES.index(family))
    return path


def load_hf(path: Path, device: torch.device, dtype: torch.dtype) -> Any:
    """transformers' model of ``path`` on ``device`` in ``dtype``, eager attention (the plainest
    implementation: soft-caps and windows as the family's own code writes them)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")
    return model.to(device=device, dtype=dtype).eval()


def shape_config(folder: Path, shape: dict[str, Any]) -> ModelConfig:
    """Write ``shape`` as ``folder/config.json`` and read it back as the engine reads a model."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(shape, indent=1))
    return ModelConfig.from_dir(folder)


def random_weights(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, seed: int = 0) -> ModelWeights:
    """Random weights of a Llama-shaped ``cfg`` (no q/k norms, no biases), made on ``device``."""
    if cfg.family != "llama":
        raise ValueError(f"random_weights builds Llama-shaped weights, not {cfg.family}")
    gen = torch.Generator(device=device).manual_seed(seed)
    h, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size

    def mat(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(rows, cols, generator=gen, device=device, dtype=dtype).mul_(0.02)  # [rows, cols]

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, device=device, dtype=dtype)  # [n]

    layers = [
        LayerWeights(input_norm=ones(h), qkv=mat(q + 2 * kv, h), qkv_bias=None, o_proj=mat(h, q),
                     post_norm=ones(h), gate_up=mat(2 * inter, h), down=mat(h, inter))
        for _ in range(cfg.num_layers)
    ]
    embed = mat(cfg.vocab_size, h)  # [vocab, hidden]
    lm_head = embed if cfg.tie_word_embeddings else mat(cfg.vocab_size, h)
    return ModelWeights(embed=embed, layers=layers, norm=ones(h), lm_head=lm_head)


def engine_config(device: str, dtype: str, backend: str, cuda_graphs: bool, **sizes: Any) -> EngineConfig:
    """The one place the check names `EngineConfig`'s backend fields (``backend``, ``cuda_graphs``;
    ``sizes``: ``num_blocks`` / ``kv_cache_memory``, ``block_size``, ``max_model_len``)."""
    return EngineConfig(device=device, dtype=dtype, backend=backend, cuda_graphs=cuda_graphs,
                        **sizes)

