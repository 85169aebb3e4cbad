"""Load a Hugging Face folder's safetensors into fused, validated per-layer weights.

Owns: finding the weight files (single file, sharded with an index, or a glob), checking every
tensor the config implies is there with the right shape, fusing q/k/v and gate/up, and casting to
the engine's dtype and device; int8 weights with a scale per group of inputs (``X.weight`` int8
and ``X.weight_scale``: GGUF Q8_0 as `engine.loading.gguf_loader` writes it) kept as `GroupQuantized`
where the engine runs int8 kernels (``keep_int8``), else dequantized to the engine's dtype.

Tensor names are the family's (`engine.model.families.WeightNames`): the loader knows no family by name.

Memory: tensors are read one at a time, each from a file opened for it alone (safetensors maps the
file; the mapping goes when the tensor has been copied out), and the parts of a fused weight are
copied straight into their rows of it, so the peak stays near the loaded model's size, not twice it.

Invariants: either a complete `ModelWeights` is returned or `ModelLoadError` is raised naming the
file and the tensor; nothing partially loaded escapes. Fusion order is fixed: ``qkv = [q; k; v]``
and ``gate_up = [gate; up]`` along dim 0. Norm gains are kept as the checkpoint stores them (``w``
even where the family's norm multiplies by ``1 + w``). No returned tensor shares memory with a file.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from engine.errors import ModelLoadError
from engine.kernels.group_int8 import GroupQuantized, Weight
from engine.model.config import ModelConfig

SCALE_SUFFIX = "_scale"  # ``X.weight_scale``: the group scales of an int8 ``X.weight``


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    qkv: Weight  # [q_size + 2 * kv_size, hidden]
    qkv_bias: torch.Tensor | None  # [q_size + 2 * kv_size]
    o_proj: Weight  # [hidden, q_size]
    post_norm: torch.Tensor  # [hidden] before the MLP (Llama's post_attention_layernorm, Gemma's pre_feedforward)
    gate_up: Weight  # [2 * intermediate, hidden]
    down: Weight  # [hidden, intermediate]
    q_norm: torch.Tensor | None = None  # [head_dim] (Qwen3: RMSNorm over each head of q)
    k_norm: torch.Tensor | None = None  # [head_dim]
    attn_out_norm: torch.Tensor | None = None  # [hidden] on o_proj's output before the residual add (Gemma)
    mlp_out_norm: torch.Tensor | None = None  # [hidden] on down's output before the residual add (Gemma)


@dataclass
class ModelWeights:
    embed: torch.Tensor  # [vocab, hidden]
    layers: list[LayerWeights]
    norm: torch.Tensor  # [hidden]
    lm_head: Weight  # [vocab, hidden]; the same storage as `embed` when tied (and dense)


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


class _Checkpoint:
    """The tensors of a folder's files by name, each read on demand (see the module docstring)."""

    def __init__(self, files: list[Path]) -> None:
        self.origin: dict[str, Path] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        for f in files:
            with self._open(f) as fh:
                for name in fh.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    self.origin[name] = f
                    self.shapes[name] = tuple(fh.get_slice(name).get_shape())

    @staticmethod
    def _open(f: Path) -> Any:
        try:
            return safe_open(str(f), framework="pt")
        except (SafetensorError, OSError, RuntimeError) as e:
            raise ModelLoadError(f"{f}: cannot read safetensors file ({e})") from None

    def read(self, names: Sequence[str], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        """The named tensors stacked along dim 0 (one name: the tensor itself) in ``dtype``: each copied
        from its file straight into its rows of the one new tensor (no copy of a part is made first;
        the file's mapping goes as soon as the part is copied)."""
        shapes = [self.shapes[n] for n in names]
        out = torch.empty((sum(s[0] for s in shapes), *shapes[0][1:]), dtype=dtype, device=device)
        row = 0
        for name, shape in zip(names, shapes, strict=True):
            f = self.origin[name]
            try:
                with self._open(f) as fh:
                    out[row : row + shape[0]].copy_(fh.get_tensor(name))
            except (SafetensorError, OSError, RuntimeError) as e:
                raise ModelLoadError(f"{f}: cannot read tensor {name!r} ({e})") from None
            row += shape[0]
        return out


def load_weights(
    folder: str | Path, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str = "cpu",
    keep_int8: bool = False,
) -> ModelWeights:
    """Read, validate, fuse and cast the weights of ``folder`` for ``cfg``; ``keep_int8``: group-quantized
    int8 linear weights stay `GroupQuantized` (for int8 kernels), else they are dequantized to ``dtype``."""
    folder = Path(folder)
    files = _weight_files(folder)
    ckpt = _Checkpoint(files)
    where = files[0] if len(files) == 1 else folder

    def check(name: str, shape: tuple[int, ...]) -> None:
        if name not in ckpt.shapes:
            raise ModelLoadError(f"{where}: weight {name!r} is missing")
        if ckpt.shapes[name] != shape:
            raise ModelLoadError(
                f"{ckpt.origin[name]}: config does not match weights: {name!r} has shape "
                f"{ckpt.shapes[name]}, the config implies {shape}"
            )

    def take(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        check(name, shape)
        return ckpt.read([name], dtype, device)

    def take_linear(parts: Sequence[tuple[str, tuple[int, ...]]]) -> Weight:
        """The linear weights ``parts`` (name, shape) stacked along dim 0: group-quantized where every
        part is (kept as such with ``keep_int8``, else dequantized), else dense in ``dtype``."""
        for name, shape in parts:
            check(name, shape)
        names = [name for name, _ in parts]
        if not any(name + SCALE_SUFFIX in ckpt.shapes for name in names):
            return ckpt.read(names, dtype, device)
        groups = set()
        for name, shape in parts:
            scale = name + SCALE_SUFFIX
            s_shape = ckpt.shapes.get(scale, ())
            if len(s_shape) != 2 or s_shape[0] != shape[0] or not s_shape[1] or shape[1] % s_shape[1]:
                raise ModelLoadError(f"{ckpt.origin[name]}: {name!r} {shape} has no group scales [{shape[0]}, "
                                     f"groups] ({scale!r}: {s_shape}), as the parts fused with it have")
            groups.add(shape[1] // s_shape[1])
        if len(groups) != 1:
            raise ModelLoadError(f"{where}: {names} are fused but have different scale groups {sorted(groups)}")
        try:
            w = GroupQuantized(ckpt.read(names, torch.int8, device),
                               ckpt.read([n + SCALE_SUFFIX for n in names], torch.float32, device), groups.pop())
        except ValueError as e:
            raise ModelLoadError(f"{ckpt.origin[names[0]]}: {e}") from None
        return w if keep_int8 else w.dequantize(dtype)

    h, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    names = cfg.features.names

    def weight(template: str, i: int, shape: tuple[int, ...]) -> torch.Tensor:
        return take(template.format(i=i) + ".weight", shape)

    def linear(*parts: tuple[str, tuple[int, ...]], i: int) -> Weight:
        return take_linear([(template.format(i=i) + ".weight", shape) for template, shape in parts])

    def optional(template: str | None, i: int, shape: tuple[int, ...]) -> torch.Tensor | None:
        return None if template is None else weight(template, i, shape)

    embed_name = names.embed + ".weight"
    embed_w = take_linear([(embed_name, (cfg.vocab_size, h))])
    embed = embed_w.dequantize(dtype) if isinstance(embed_w, GroupQuantized) else embed_w
    layers: list[LayerWeights] = []
    for i in range(cfg.num_layers):
        if names.qkv is not None:  # Phi-3: qkv_proj = [q; k; v] already
            qkv = linear((names.qkv, (q + 2 * kv, h)), i=i)
        else:
            qkv = linear((names.q, (q, h)), (names.k, (kv, h)), (names.v, (kv, h)), i=i)
        if names.gate_up is not None:  # Phi-3: gate_up_proj = [gate; up] already
            gate_up = linear((names.gate_up, (2 * inter, h)), i=i)
        else:
            gate_up = linear((names.gate, (inter, h)), (names.up, (inter, h)), i=i)
        bias = None
        if cfg.attention_bias:
            biases = [(names.q.format(i=i) + ".bias", (q,)), (names.k.format(i=i) + ".bias", (kv,)),
                      (names.v.format(i=i) + ".bias", (kv,))]
            for name, shape in biases:
                check(name, shape)
            bias = ckpt.read([name for name, _ in biases], dtype, device)
        qk_names = (names.q_norm, names.k_norm) if cfg.qk_norm else (None, None)
        layers.append(
            LayerWeights(
                input_norm=weight(names.input_norm, i, (h,)),
                qkv=qkv,
                qkv_bias=bias,
                o_proj=linear((names.o, (h, q)), i=i),
                post_norm=weight(names.pre_mlp_norm, i, (h,)),
                gate_up=gate_up,
                down=linear((names.down, (h, inter)), i=i),
                q_norm=optional(qk_names[0], i, (cfg.head_dim,)),
                k_norm=optional(qk_names[1], i, (cfg.head_dim,)),
                attn_out_norm=optional(names.attn_out_norm, i, (h,)),
                mlp_out_norm=optional(names.mlp_out_norm, i, (h,)),
            )
        )
    norm = take(names.final_norm + ".weight", (h,))
    lm_head_name = names.lm_head + ".weight"
    lm_head: Weight
    if cfg.tie_word_embeddings or lm_head_name not in ckpt.shapes:
        if not cfg.tie_word_embeddings:
            raise ModelLoadError(f"{where}: weight {lm_head_name!r} is missing (embeddings are not tied)")
        lm_head = embed_w if isinstance(embed_w, GroupQuantized) else embed
    else:
        lm_head = take_linear([(lm_head_name, (cfg.vocab_size, h))])
    extra_layer = names.input_norm.format(i=cfg.num_layers) + ".weight"
    if extra_layer in ckpt.shapes:
        raise ModelLoadError(
            f"{ckpt.origin[extra_layer]}: config does not match weights: the file has more than "
            f"num_hidden_layers={cfg.num_layers} layers"
        )
    return ModelWeights(embed=embed, layers=layers, norm=norm, lm_head=lm_head)
