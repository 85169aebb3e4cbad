"""Sampling parameters and the sampler.

Owns: `SamplingParams` (what a request asks for) and `sample()` (logits → token ids + log-probs).

Invariants: greedy (``temperature == 0``) is an argmax and ignores top-k/top-p/seed; a request
with a ``seed`` draws from its own ``torch.Generator`` so its text does not depend on the batch it
ran in; the log-probability returned is of the chosen token under the *unmodified* distribution
(temperature 1, no truncation), as OpenAI's API reports it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SamplingParams:
    """Per-request generation settings (validated at construction)."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 or positive, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class SamplerState:
    """Mutable per-sequence sampler state (the seeded generator lives here)."""

    params: SamplingParams
    generator: torch.Generator | None = field(default=None)

    @classmethod
    def new(cls, params: SamplingParams) -> SamplerState:
        gen = None
        if params.seed is not None and not params.greedy:
            gen = torch.Generator()
            gen.manual_seed(params.seed)
        return cls(params=params, generator=gen)
