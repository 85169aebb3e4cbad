"""The attention backend seam: what every backend implements, and the spec it is built for.

Owns: `AttentionBackend` (the per-step / per-layer interface the model calls), `AttentionSpec` (the
model's attention geometry, RoPE tables and per-layer rules a backend is built for) and
`LayerAttention` (one layer's rules). The model calls exactly two things per forward: one
``prepare_*`` per step (metadata built once: positions → RoPE rows, block tables → whatever the
kernels read) and ``forward(layer, qkv, cache, meta)`` per layer; the backend rotates q and k,
stores k and v into the paged cache and attends. A decode step as a whole runs through
`AttentionBackend.decode_step`, which a backend may replace by a fused or captured step (the CPU
backend's one-call native step, the torch backend's CUDA graphs) that computes the same logits.

Invariants (every backend, tested against `reference`): a query at position ``p`` sees exactly its
own sequence's keys at positions ``0..p`` (and only the last ``window`` of them in a windowed
layer); the KV of every input token is in its cache slot (``block_table[p // bs] * bs + p % bs``)
before attention reads it; a row's output does not depend on the other rows of the batch beyond
float reassociation; metadata is built once per step and shared by every layer; backends keep no
per-request state.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Protocol

import torch

from engine.batch import DecodeBatch, PrefillBatch
from engine.device_copy import send
from engine.kv_cache import KVCache

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.model.rope import RopeTables


@dataclass(frozen=True)
class LayerAttention:
    """One layer's attention rules beyond q, k and v."""

    rope: int  # index of the layer's tables in `AttentionSpec.ropes`
    scale: float  # multiplies q·k
    window: int | None = None  # the last ``window`` positions only (the query's own included); None: all
    softcap: float | None = None  # scores become ``cap * tanh(scores / cap)`` before the mask (Gemma 2)


@dataclass(frozen=True)
class AttentionSpec:
    """What a backend is built for: the model's attention geometry and rules, and where it runs."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    layers: tuple[LayerAttention, ...]
    ropes: Sequence[RopeTables]  # one per distinct RoPE of the layers
    length_dependent: bool  # a token's RoPE table depends on its forward call's length (longrope, NTK)
    device: torch.device
    dtype: torch.dtype

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def softcapped(self) -> bool:
        return any(layer.softcap is not None for layer in self.layers)

    @property
    def windowed(self) -> bool:
        return any(layer.window is not None for layer in self.layers)

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """qkv [T, q + 2kv] → views q [T, H, D], k [T, KV, D], v [T, KV, D]."""
        t, d = qkv.shape[0], self.head_dim
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return q.view(t, self.num_heads, d), k.view(t, self.num_kv_heads, d), v.view(t, self.num_kv_heads, d)


def prefill_call_lengths(spec: AttentionSpec, batch: PrefillBatch) -> torch.Tensor | None:
    """[T] each token's forward-call length for a length-dependent RoPE (its whole prompt's, as
    transformers' one prefill call), else None."""
    if not spec.length_dependent:
        return None
    lens = torch.repeat_interleave(torch.tensor(batch.prompt_lens), torch.tensor(batch.seq_lens))  # [T]
    return send(lens, spec.device)


def decode_call_lengths(spec: AttentionSpec, batch: DecodeBatch) -> torch.Tensor | None:
    """[B] a decode token at position p is its own forward call of p + 1 tokens (transformers' step)."""
    return batch.positions + 1 if spec.length_dependent else None


class StepModel(Protocol):
    """What a backend calls of the model it serves (`engine.model.model.LlamaModel`)."""

    def forward(self, token_ids: torch.Tensor, cache: KVCache, meta: object) -> torch.Tensor: ...

    def logits(self, h: torch.Tensor) -> torch.Tensor: ...

    def embed_tokens(self, token_ids: torch.Tensor) -> torch.Tensor: ...


class AttentionBackend(ABC):
    """RoPE, KV store and attention over the paged cache for one engine (see the module docstring).

    A subclass is one module registered by name in `engine.attention.registry`. ``unavailable``
    says why it cannot run a spec on a device (None: it can); `prepare_model` is the place for a
    backend's weight formats (module swaps after the model is built, gpt-fast style).
    """

    name: ClassVar[str]

    def __init__(self, spec: AttentionSpec, config: EngineConfig) -> None:
        self.spec = spec
        self.config = config

    @classmethod
    def unavailable(cls, spec: AttentionSpec, config: EngineConfig) -> str | None:
        """Why this backend cannot run ``spec`` under ``config`` (None: it can)."""
        return None

    def prepare_model(self, model: StepModel) -> None:
        """Swap the model's linear kernels for this backend's formats (default: keep the plain ones)."""
        return None

    @abstractmethod
    def prepare_prefill(self, batch: PrefillBatch, cache: KVCache) -> object:
        """Metadata for one prefill forward of packed chunks, shared by every layer."""

    @abstractmethod
    def prepare_decode(self, batch: DecodeBatch, cache: KVCache) -> object:
        """Metadata for one decode step (one token per sequence), shared by every layer."""

    @abstractmethod
    def forward(self, layer: int, qkv: torch.Tensor, cache: KVCache, meta: object) -> torch.Tensor:
        """qkv [T, q + 2kv] (q and k not yet rotated) → attention output [T, H * D]; k and v stored."""

    def decode_step(self, model: StepModel, batch: DecodeBatch, cache: KVCache) -> torch.Tensor:
        """One decode step's fp32 logits [B, vocab]; a backend may run it fused or captured."""
        return model.logits(model.forward(batch.token_ids, cache, self.prepare_decode(batch, cache)))

    def warm_up(self, model: StepModel, cache: KVCache) -> None:
        """Compile or capture what the first request would otherwise pay for (default: nothing)."""
        return None

    def report(self) -> dict[str, object]:
        """The backend and its choices, for benchmark records (JSON-able)."""
        return {"backend": self.name}

    def describe(self) -> str:
        """One line for the load log: the backend and the choices it made."""
        return self.name
