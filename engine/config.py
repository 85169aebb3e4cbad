"""Model and engine configuration.

Owns: `ModelConfig` (the architecture, read from a Hugging Face ``config.json``) and `EngineConfig`
(how one process runs it: device, dtype, KV block geometry, batch limits).

Invariants: a `ModelConfig` is frozen and self-consistent (``num_heads % num_kv_heads == 0``,
``head_dim * num_heads`` need not equal ``hidden_size`` but every size is positive); unknown
architectures are refused by name, never guessed.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from engine.attention_choice import DECODE_ATTENTION
from engine.errors import ModelLoadError
from engine.kernel_choice import LINEAR_KERNELS

#: Hugging Face ``architectures`` entries we can run, mapped to our family name.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
}
_LAYER_TYPES = ("full_attention", "sliding_attention")

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


#: ``dtype: auto``: the fastest dtype the device computes in, resolved when an `EngineConfig` is built.
AUTO_DTYPE = "auto"


def fast_dtype(device: str) -> str:
    """What ``dtype: auto`` means on ``device``: bf16 on CUDA and on CPUs with bf16 arithmetic
    (AVX512-BF16 or AMX), whose bf16 matmuls run at a multiple of fp32's rate and read half the
    bytes; fp32 on other CPUs, whose bf16 would be emulated. Greedy exactness against transformers
    is an fp32 property: ask for float32 for it."""
    if device.startswith("cuda"):
        return "bfloat16"
    if torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported():
        return "bfloat16"
    return "float32"


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """``"bf16"`` / ``"bfloat16"`` / ``torch.bfloat16`` → ``torch.bfloat16``; unknown names raise.
    ``"auto"`` is not a dtype: resolve it with `fast_dtype` first."""
    if isinstance(name, torch.dtype):
        return name
    try:
        return _DTYPES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(_DTYPES)} or 'auto'") from None


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


@dataclass(frozen=True)
class ModelConfig:
    """The architecture of one Llama-family model.

    ``sliding_window``: the keys a query of a windowed layer sees, itself included (positions
    ``p - window + 1 .. p``, transformers' definition), in the layers ``window_layers`` names; None
    with no windowed layer. ``qk_norm``: an RMSNorm over each head of q and of k before RoPE (Qwen3).
    """

    family: str  # "llama" | "mistral" | "qwen2" | "qwen3" | "phi3"
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
        family = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if family is None:
            model_type = cfg.get("model_type")
            if model_type in SUPPORTED_ARCHITECTURES.values():
                family = str(model_type)
            else:
                raise ModelLoadError(
                    f"{source}: unsupported architecture {archs or model_type!r}; "
                    f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
                )
        try:
            num_heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            head_dim = int(cfg.get("head_dim") or hidden // num_heads)
            # transformers < 5 writes `rope_scaling` + `rope_theta`; 5.x writes `rope_parameters`.
            rs = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
            rope_theta = float(rs.get("rope_theta", cfg.get("rope_theta", 10000.0)))
            scaling = _rope_scaling(rs, int(cfg.get("max_position_embeddings", 2048)), source)
            if float(rs.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))) != 1.0:
                raise ModelLoadError(f"{source}: partial_rotary_factor != 1 is not supported (RoPE over whole heads)")
            _refuse_unsupported(cfg, family, source)
            window, window_layers = _windows(cfg, family, int(cfg["num_hidden_layers"]), source)
            eos = cfg.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            return cls(
                family=family,
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=num_heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
                head_dim=head_dim,
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=rope_theta,
                max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=bool(cfg.get("attention_bias", family == "qwen2")),
                rope_scaling=scaling,
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=eos_ids,
                sliding_window=window,
                window_layers=window_layers,
                qk_norm=family == "qwen3",
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


def _refuse_unsupported(cfg: dict[str, Any], family: str, source: str) -> None:
    """Raises `ModelLoadError` naming a field whose value this engine would not run exactly."""
    act = cfg.get("hidden_act", cfg.get("hidden_activation", "silu"))
    if act != "silu":
        raise ModelLoadError(f"{source}: hidden_act={act!r} is not supported (the MLP is SwiGLU with silu)")
    if cfg.get("mlp_bias"):
        raise ModelLoadError(f"{source}: mlp_bias=true is not supported (the MLP projections carry no bias)")
    if cfg.get("attention_bias") and family != "qwen2":
        raise ModelLoadError(f"{source}: attention_bias=true is not supported for {family} (o_proj bias)")


def _windows(cfg: dict[str, Any], family: str, num_layers: int, source: str) -> tuple[int | None, tuple[int, ...]]:
    """The sliding window and the layers that use it, as transformers reads them: ``layer_types``
    where the config has it; else Mistral and Phi-3 window every layer, Qwen2/Qwen3 (with
    ``use_sliding_window``) the layers from ``max_window_layers`` on."""
    window = cfg.get("sliding_window")
    if family in ("qwen2", "qwen3") and not cfg.get("use_sliding_window"):
        window = None
    if family == "llama":
        window = None  # transformers' Llama has no window, whatever the file says
    types = cfg.get("layer_types")
    if types is not None:
        if len(types) != num_layers or any(t not in _LAYER_TYPES for t in types):
            raise ModelLoadError(f"{source}: layer_types must list one of {_LAYER_TYPES} per layer "
                                 f"({num_layers}), got {types!r}")
        layers = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
        if layers and window is None:
            raise ModelLoadError(f"{source}: layer_types has sliding_attention layers but sliding_window is unset")
    elif window is None:
        layers = ()
    elif family in ("mistral", "phi3"):
        layers = tuple(range(num_layers))
    else:
        layers = tuple(range(int(cfg.get("max_window_layers", num_layers)), num_layers))
    return (int(window) if layers and window is not None else None), layers


@dataclass(frozen=True)
class EngineConfig:
    """How one process runs a model: device, dtype, paged-KV geometry and batch limits.

    ``dtype="auto"`` is resolved at construction (`fast_dtype`), so ``dtype`` is always a concrete
    name after it. A cluster builds its replicas' configs where the app is built: every replica of
    an app gets the same dtype, and so the same KV layout, whatever node it lands on.
    """

    device: str = "cpu"
    dtype: str = "float32"
    block_size: int = 16
    num_blocks: int = 1024
    max_num_seqs: int = 64
    max_model_len: int | None = None  # defaults to the model's max_position_embeddings
    enable_prefix_cache: bool = True
    num_threads: int | None = None  # torch intra-op threads; None leaves torch's default
    cpu_affinity: tuple[int, ...] = ()  # pin this process to these cores (benchmarks on small machines)
    quantization: str | None = None  # None, or "int8": weight-only int8 linear layers (`engine.quant`)
    fast_kernels: bool = True  # False: the plain reference forward (F.linear, slot gathers), for tests
    linear_kernels: str = "auto"  # "auto" (timed at load), "packed"/"plain" (oneDNN) or "native" (C++ kernel)
    decode_attention: str = "auto"  # "auto" (timed at load), "compiled" (torch.compile) or an eager method

    def __post_init__(self) -> None:
        if self.dtype == AUTO_DTYPE:
            object.__setattr__(self, "dtype", fast_dtype(self.device))
        parse_dtype(self.dtype)
        if self.quantization not in (None, "int8"):
            raise ValueError(f"unknown quantization {self.quantization!r}; expected None or 'int8'")
        if self.linear_kernels not in LINEAR_KERNELS:
            raise ValueError(f"unknown linear_kernels {self.linear_kernels!r}; expected one of {LINEAR_KERNELS}")
        if self.decode_attention not in DECODE_ATTENTION:
            raise ValueError(
                f"unknown decode_attention {self.decode_attention!r}; expected one of {DECODE_ATTENTION}"
            )

    @cached_property
    def torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype)

    @cached_property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)
