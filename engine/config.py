"""Engine configuration.

Owns: `EngineConfig` (how one process runs a model: device, dtype, KV block geometry and memory
budget, batch limits), the dtype helpers (`parse_dtype`; ``dtype: auto`` as `fast_dtype` /
`auto_dtype`; `checkpoint_dtype`, what a ``config.json`` says its weights are stored in) and the
names the CPU backend's choices are validated against (`LINEAR_KERNELS`, `DECODE_ATTENTION`). The
model's architecture is `engine.model.config.ModelConfig`.

Invariants: an `EngineConfig` is frozen and its ``dtype`` concrete (``auto`` resolved at
construction); an unknown dtype, backend or kernel name is refused by name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from engine.attention.names import BACKENDS
from engine.kv_budget import DEFAULT_DEVICE_FRACTION, Budget, check_budget

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


#: The CPU backend's linear kernel formats (`engine.kernels.kernel_choice`): timed at load, or pinned.
LINEAR_KERNELS = ("auto", "packed", "plain", "native")
#: The CPU backend's decode attention methods (`engine.kernels.attention_choice`): timed at load, or pinned.
DECODE_ATTENTION = ("auto", "sdpa", "per_head", "block_diagonal", "compiled", "native")

#: ``dtype: auto``: the fastest dtype the device computes in, resolved when an `EngineConfig` is built.
AUTO_DTYPE = "auto"


def fast_dtype(device: str) -> str:
    """What ``dtype: auto`` means on ``device`` for a checkpoint that names no dtype (or fp32): bf16
    on CUDA and on CPUs with bf16 arithmetic (AVX512-BF16 or AMX), whose bf16 matmuls run at a
    multiple of fp32's rate and read half the bytes; fp32 on other CPUs, whose bf16 would be
    emulated. Greedy exactness against transformers is an fp32 property: ask for float32 for it."""
    if device.startswith("cuda"):
        return "bfloat16"
    if torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported():
        return "bfloat16"
    return "float32"


def auto_dtype(device: str, checkpoint: torch.dtype | None = None) -> str:
    """What ``dtype: auto`` means for weights stored in ``checkpoint`` (`checkpoint_dtype`; None:
    unknown) on ``device``. The rule:

    - bf16 checkpoint: bf16 where the device computes in it (`fast_dtype`), else fp32 (a CPU without
      bf16 matmul: the weights widened, exactly);
    - fp16 checkpoint: fp16 on CUDA; on a CPU (whose kernels have no fp16 path) bf16 where it
      computes in bf16, as vLLM does (the values rounded to bf16's 8 bits), else fp32 (exact);
    - fp32 or unknown: `fast_dtype` (an fp32 checkpoint runs in bf16 where that is fast, as in vLLM).
    """
    if checkpoint == torch.float16 and device.startswith("cuda"):
        return "float16"
    return fast_dtype(device)


def checkpoint_dtype(cfg: dict[str, Any]) -> torch.dtype | None:
    """The dtype a ``config.json`` says its weights are stored in: its ``torch_dtype``, else ``dtype``
    (the key newer transformers write); None where it names none (or no float dtype we know)."""
    name = cfg.get("torch_dtype") or cfg.get("dtype")
    if not isinstance(name, str):
        return None
    return _DTYPES.get(name.lower().removeprefix("torch."))


def folder_checkpoint_dtype(folder: str | Path) -> torch.dtype | None:
    """`checkpoint_dtype` of ``folder/config.json``; None where there is no readable one."""
    try:
        cfg = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return checkpoint_dtype(cfg) if isinstance(cfg, dict) else None


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
class EngineConfig:
    """How one process runs a model: device, dtype, paged-KV geometry and batch limits.

    ``dtype="auto"`` is resolved at construction (`fast_dtype`: the device's rule, for a checkpoint
    whose dtype is not known yet), so ``dtype`` is always a concrete name after it; a cluster resolves
    ``auto`` with the checkpoint's dtype where it can read it (`auto_dtype`) before building this. A
    cluster builds its replicas' configs where the app is built: every replica of an app gets the
    same dtype, and so the same KV layout, whatever node it lands on.
    """

    device: str = "cpu"
    dtype: str = "float32"
    block_size: int = 16
    # The KV cache (`engine.kv_budget`): ``num_blocks`` None sizes it from ``kv_cache_memory`` (bytes, or
    # a fraction of the device's total memory for the whole engine; None: 0.9 on CUDA, no budget on a
    # CPU, where ``num_blocks`` None means 1,024); given with a budget, it is checked against it.
    num_blocks: int | None = None
    kv_cache_memory: int | float | None = None
    reserved_memory: int = 0  # bytes held back from the KV budget for KV transfers in flight
    max_step_tokens: int | None = None  # the most tokens one forward runs (its peak is profiled); None: max_model_len
    max_num_seqs: int = 64
    max_model_len: int | None = None  # defaults to the model's `ModelConfig.max_context`
    enable_prefix_cache: bool = True
    num_threads: int | None = None  # torch intra-op threads; None leaves torch's default
    cpu_affinity: tuple[int, ...] = ()  # pin this process to these cores (benchmarks on small machines)
    quantization: str | None = None  # None, or "int8": weight-only int8 linear layers (`engine.kernels.quant`)
    # the attention backend (`engine.attention.registry`): "auto", "reference", "cpu" or "torch"
    backend: str = "auto"
    cuda_graphs: bool = True  # the torch backend captures decode steps as CUDA graphs (on CUDA only)
    # the cpu backend's choices: "auto" (timed at load), "packed"/"plain" (oneDNN) or "native" (C++ kernel)
    linear_kernels: str = "auto"
    decode_attention: str = "auto"  # the cpu backend's: "auto" (timed at load), "compiled" or an eager method

    def __post_init__(self) -> None:
        if self.dtype == AUTO_DTYPE:
            object.__setattr__(self, "dtype", fast_dtype(self.device))
        parse_dtype(self.dtype)
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks={self.num_blocks} must be at least 1 (or unset: sized from kv_cache_memory)")
        if self.kv_cache_memory is not None:
            check_budget(self.kv_cache_memory)
        if self.reserved_memory < 0:
            raise ValueError(f"reserved_memory={self.reserved_memory} must be >= 0 bytes")
        if self.max_step_tokens is not None and self.max_step_tokens < 1:
            raise ValueError(f"max_step_tokens={self.max_step_tokens} must be at least 1")
        if self.quantization not in (None, "int8"):
            raise ValueError(f"unknown quantization {self.quantization!r}; expected None or 'int8'")
        if self.backend != "auto" and self.backend not in BACKENDS:
            raise ValueError(f"unknown backend {self.backend!r}; expected 'auto' or one of {sorted(BACKENDS)}")
        if self.linear_kernels not in LINEAR_KERNELS:
            raise ValueError(f"unknown linear_kernels {self.linear_kernels!r}; expected one of {LINEAR_KERNELS}")
        if self.decode_attention not in DECODE_ATTENTION:
            raise ValueError(
                f"unknown decode_attention {self.decode_attention!r}; expected one of {DECODE_ATTENTION}"
            )

    @property
    def kv_budget(self) -> Budget | None:
        """``kv_cache_memory``, or its default: `DEFAULT_DEVICE_FRACTION` on CUDA, no budget on a CPU."""
        if self.kv_cache_memory is not None:
            return self.kv_cache_memory
        return DEFAULT_DEVICE_FRACTION if self.torch_device.type == "cuda" else None

    @cached_property
    def torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype)

    @cached_property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)
