"""Sampling parameters and the sampler.

Owns: `SamplingParams` (what a request asks for), `SamplingDefaults` (what a model asks for when the
request does not) and `sample()` (logits → token ids + log-probs).

Invariants: greedy (``temperature == 0``) is an argmax and ignores top-k/top-p/seed; a request
with a ``seed`` draws from its own ``torch.Generator`` so its text does not depend on the batch it
ran in; the log-probability returned is of the chosen token under the *unmodified* distribution
(temperature 1, no truncation), as OpenAI's API reports it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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

    def is_stop(self, token_id: int, eos_ids: Sequence[int]) -> bool:
        """Whether ``token_id`` ends the sequence: a stop id, or EOS unless ``ignore_eos``."""
        return token_id in self.stop_token_ids or (not self.ignore_eos and token_id in eos_ids)


@dataclass(frozen=True)
class SamplingDefaults:
    """A model's own sampling settings (its ``generation_config.json``), for requests that set none.

    None: the model says nothing, and the API's default applies.
    """

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None

    def __post_init__(self) -> None:
        SamplingParams(temperature=0.0 if self.temperature is None else self.temperature,  # raises if out of range
                       top_p=1.0 if self.top_p is None else self.top_p, top_k=0 if self.top_k is None else self.top_k)


@dataclass
class SamplerState:
    """Mutable per-sequence sampler state.

    A seeded request draws token ``t`` from a generator seeded with ``(seed, t)``, so the text
    depends only on the seed — not on the batch it ran in, nor on which process sampled which token
    (token 0 on a prefill replica, the rest on a decode replica gives the same text as colocated).
    """

    params: SamplingParams
    step: int = 0  # index of the next token this state will sample

    @classmethod
    def new(cls, params: SamplingParams, start_step: int = 0) -> SamplerState:
        return cls(params=params, step=start_step)

    def next_generator(self) -> torch.Generator | None:
        step = self.step
        self.step += 1
        if self.params.seed is None or self.params.greedy:
            return None
        gen = torch.Generator()
        gen.manual_seed((self.params.seed * 1_000_003 + step) & 0x7FFF_FFFF_FFFF_FFFF)
        return gen


def _filter(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits: [V] (already temperature-scaled) → logits with excluded tokens at -inf."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the mass strictly before it already reaches top_p (keeps >= 1 token).
        drop = (probs.cumsum(-1) - probs) >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(0, order, sorted_logits)
    return logits


def sample(logits: torch.Tensor, states: list[SamplerState]) -> tuple[list[int], list[float]]:
    """logits: fp32 [B, V], one row per state → (token ids, log-probs of the chosen tokens)."""
    logits = logits.float()
    logprobs_all = torch.log_softmax(logits, dim=-1)  # [B, V]
    greedy_ids = logits.argmax(dim=-1)  # [B]
    out_ids: list[int] = []
    for i, st in enumerate(states):
        p = st.params
        gen = st.next_generator()
        if p.greedy:
            out_ids.append(int(greedy_ids[i]))
            continue
        row = _filter(logits[i] / p.temperature, p.top_k, p.top_p)
        probs = row.softmax(-1)
        out_ids.append(int(torch.multinomial(probs, 1, generator=gen)))
    idx = torch.tensor(out_ids, dtype=torch.long, device=logits.device)
    chosen = logprobs_all.gather(1, idx.unsqueeze(1)).squeeze(1)
    return out_ids, [float(x) for x in chosen]
