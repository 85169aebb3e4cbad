"""Load a Hugging Face folder's safetensors into fused, validated per-layer weights.

Owns: finding the weight files (single file, sharded with an index, or a glob), checking every
tensor the config implies is there with the right shape, fusing q/k/v and gate/up, and casting to
the engine's dtype and device.

Tensor names are the family's (`engine.families.WeightNames`): the loader knows no family by name.

Invariants: either a complete `ModelWeights` is returned or `ModelLoadError` is raised naming the
file and the tensor; nothing partially loaded escapes. Fusion order is fixed: ``qkv = [q; k; v]``
and ``gate_up = [gate; up]`` along dim 0. Norm gains are kept as the checkpoint stores them (``w``
even where the family's norm multiplies by ``1 + w``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from engine.config import ModelConfig
from engine.errors import ModelLoadError


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    qkv: torch.Tensor  # [q_size + 2 * kv_size, hidden]
    qkv_bias: torch.Tensor | None  # [q_size + 2 * kv_size]
    o_proj: torch.Tensor  # [hidden, q_size]
    post_norm: torch.Tensor  # [hidden] before the MLP (Llama's post_attention_layernorm, Gemma's pre_feedforward)
    gate_up: torch.Tensor  # [2 * intermediate, hidden]
    down: torch.Tensor  # [hidden, intermediate]
    q_norm: torch.Tensor | None = None  # [head_dim] (Qwen3: RMSNorm over each head of q)
    k_norm: torch.Tensor | None = None  # [head_dim]
    attn_out_norm: torch.Tensor | None = None  # [hidden] on o_proj's output before the residual add (Gemma)
    mlp_out_norm: torch.Tensor | None = None  # [hidden] on down's output before the residual add (Gemma)


@dataclass
class ModelWeights:
    embed: torch.Tensor  # [vocab, hidden]
    layers: list[LayerWeights]
    norm: torch.Tensor  # [hidden]
    lm_head: torch.Tensor  # [vocab, hidden]; the same storage as `embed` when tied


def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ModelLoadError(f"{index}: not a valid safetensors index ({e})") from None
        files = sorted({folder / name for name in weight_map.values()})
        for f in files:
            if not f.is_file():
                raise ModelLoadError(f"{f}: shard named in {index.name} is missing")
        return files
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder}: no *.safetensors weights found")
    return files


def _read_all(files: list[Path]) -> tuple[dict[str, torch.Tensor], dict[str, Path]]:
    tensors: dict[str, torch.Tensor] = {}
    origin: dict[str, Path] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as fh:
                for name in fh.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    tensors[name] = fh.get_tensor(name)
                    origin[name] = f
        except (SafetensorError, OSError, RuntimeError) as e:
            raise ModelLoadError(f"{f}: cannot read safetensors file ({e})") from None
    return tensors, origin


def load_weights(
    folder: str | Path, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str = "cpu"
) -> ModelWeights:
    """Read, validate, fuse and cast the weights of ``folder`` for ``cfg``."""
    folder = Path(folder)
    files = _weight_files(folder)
    raw, origin = _read_all(files)
    where = files[0] if len(files) == 1 else folder

    def take(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        t = raw.get(name)
        if t is None:
            raise ModelLoadError(f"{where}: weight {name!r} is missing")
        if tuple(t.shape) != shape:
            raise ModelLoadError(
                f"{origin[name]}: config does not match weights: {name!r} has shape "
                f"{tuple(t.shape)}, the config implies {shape}"
            )
        return t.to(device=device, dtype=dtype)

    h, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    names = cfg.features.names

    def weight(template: str, i: int, shape: tuple[int, ...]) -> torch.Tensor:
        return take(template.format(i=i) + ".weight", shape)

    def optional(template: str | None, i: int, shape: tuple[int, ...]) -> torch.Tensor | None:
        return None if template is None else weight(template, i, shape)

    embed = take(names.embed + ".weight", (cfg.vocab_size, h))
    layers: list[LayerWeights] = []
    for i in range(cfg.num_layers):
        if names.qkv is not None:  # Phi-3: qkv_proj = [q; k; v] already
            qkv = weight(names.qkv, i, (q + 2 * kv, h))
        else:
            qkv = torch.cat([weight(names.q, i, (q, h)), weight(names.k, i, (kv, h)),
                             weight(names.v, i, (kv, h))])
        if names.gate_up is not None:  # Phi-3: gate_up_proj = [gate; up] already
            gate_up = weight(names.gate_up, i, (2 * inter, h))
        else:
            gate_up = torch.cat([weight(names.gate, i, (inter, h)), weight(names.up, i, (inter, h))])
        bias = None
        if cfg.attention_bias:
            bias = torch.cat([take(names.q.format(i=i) + ".bias", (q,)), take(names.k.format(i=i) + ".bias", (kv,)),
                              take(names.v.format(i=i) + ".bias", (kv,))])
        qk_names = (names.q_norm, names.k_norm) if cfg.qk_norm else (None, None)
        layers.append(
            LayerWeights(
                input_norm=weight(names.input_norm, i, (h,)),
                qkv=qkv,
                qkv_bias=bias,
                o_proj=weight(names.o, i, (h, q)),
                post_norm=weight(names.pre_mlp_norm, i, (h,)),
                gate_up=gate_up,
                down=weight(names.down, i, (h, inter)),
                q_norm=optional(qk_names[0], i, (cfg.head_dim,)),
                k_norm=optional(qk_names[1], i, (cfg.head_dim,)),
                attn_out_norm=optional(names.attn_out_norm, i, (h,)),
                mlp_out_norm=optional(names.mlp_out_norm, i, (h,)),
            )
        )
    norm = take(names.final_norm + ".weight", (h,))
    lm_head_name = names.lm_head + ".weight"
    if cfg.tie_word_embeddings or lm_head_name not in raw:
        if not cfg.tie_word_embeddings:
            raise ModelLoadError(f"{where}: weight {lm_head_name!r} is missing (embeddings are not tied)")
        lm_head = embed
    else:
        lm_head = take(lm_head_name, (cfg.vocab_size, h))
    extra_layer = names.input_norm.format(i=cfg.num_layers) + ".weight"
    if extra_layer in raw:
        raise ModelLoadError(
            f"{origin[extra_layer]}: config does not match weights: the file has more than "
            f"num_hidden_layers={cfg.num_layers} layers"
        )
    return ModelWeights(embed=embed, layers=layers, norm=norm, lm_head=lm_head)
