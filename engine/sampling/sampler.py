"""Sampling parameters and the batched sampler.

Owns: `SamplingParams` (what a request asks for), `SamplingDefaults` (what a model asks for when the
request does not), `SamplerState` (one sequence's prompt, output and penalty book) and `sample()`
(a step's logits → token ids, their log-probs and the most likely alternatives, `Sampled`).

The pipeline, over the step's rows (vLLM's order; a stage runs only when some row needs it, so
plain requests pay for none of them):

1. ``logit_bias`` added; the stop ids (EOS unless ``ignore_eos``, and ``stop_token_ids``) masked
   while the output is shorter than ``min_tokens``; then the grammar's mask (structured outputs,
   `engine.sampling.grammar.mask_logits`: what the grammar does not allow next at -inf);
2. repetition penalty (transformers' definition: over prompt and output tokens, a positive logit
   divided by it, a negative one multiplied), then frequency and presence penalties (OpenAI's:
   ``logit - count * frequency - (count > 0) * presence`` over the output tokens), as a gather and
   a scatter over only the ids in each row's `PenaltyBook`;
3. greedy rows (``temperature == 0``) take the argmax here; for the others, min-p (tokens below
   ``min_p`` times the top probability), top-k (ties with the k-th kept) and top-p (the smallest
   head whose mass reaches ``top_p``, with the tokens tied with its last) at the row's temperature
   become one cut per row, and a token is drawn from the softmax of what is left by inverse CDF
   from one uniform number (engine/sampling/draw.py says how, and why on the host for CPU logits).

Two paths run this pipeline: CPU logits go to numpy after stage 2 (engine/sampling/draw.py);
logits on a device stay there, as batched torch ops with one copy back per step
(engine/sampling/device.py, which says where rounding may part the two). Stages 1 and 2 and the
uniforms are the same functions in both (engine/sampling/stages.py).

Invariants: a request with a ``seed`` draws token ``t`` from the number of a generator seeded from
``(seed, t)``, and a row's cut and draw read nothing of the other rows, so its text depends only on
the seed, not on the batch it ran in nor on which process sampled which token (token 0 on a prefill
replica, the rest on a decode replica gives the same text as colocated); a decode replica rebuilds
a state from the prompt and the tokens so far (a grammar's matcher too, by replaying them). Greedy
rows take the argmax of the masked logits.
The log-probabilities returned (the chosen token's and the ``top_logprobs`` most likely) are of the
*unmodified* distribution (no bias, penalty, temperature or truncation), as OpenAI's API reports them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.sampling import device
from engine.sampling.draw import argmax, draw, host, truncate
from engine.sampling.grammar import (
    GrammarError,
    GrammarMatcher,
    GrammarSpec,
    GrammarVocab,
    compile_grammar,
    mask_logits,
)
from engine.sampling.stages import Sampled, TopLogprobs, bias_and_min_tokens, penalties, uniforms

__all__ = ["MAX_TOP_LOGPROBS", "PenaltyBook", "Sampled", "SamplerState", "SamplingDefaults", "SamplingParams",
           "TopLogprobs", "bias_and_min_tokens", "penalties", "sample"]

MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    """Per-request generation settings (validated at construction)."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0  # the most likely alternatives to report with each token (needs logprobs)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in -100..100)
    min_tokens: int = 0
    grammar: GrammarSpec | None = None  # structured outputs: the output must match it

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 or positive, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2 <= self.presence_penalty <= 2 or not -2 <= self.frequency_penalty <= 2:
            raise ValueError("presence_penalty and frequency_penalty must be in [-2, 2]")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if any(t < 0 or not -100 <= b <= 100 for t, b in self.logit_bias):
            raise ValueError("logit_bias takes token ids >= 0 and biases in [-100, 100]")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def counts_output(self) -> bool:
        """Whether the frequency / presence penalties need the output's token counts."""
        return self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    def is_stop(self, token_id: int, eos_ids: Sequence[int]) -> bool:
        """Whether ``token_id`` ends the sequence: a stop id, or EOS unless ``ignore_eos``."""
        return token_id in self.stop_token_ids or (not self.ignore_eos and token_id in eos_ids)


@dataclass(frozen=True)
class SamplingDefaults:
    """A model's own sampling settings (its ``generation_config.json``), for requests that set none.

    None: the model says nothing, and the API's default applies. ``max_tokens`` is the file's
    ``max_new_tokens`` (transformers' name for it), as vLLM takes it.
    """

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {self.max_tokens}")
        SamplingParams(temperature=0.0 if self.temperature is None else self.temperature,  # raises if out of range
                       top_p=1.0 if self.top_p is None else self.top_p, top_k=0 if self.top_k is None else self.top_k,
                       min_p=0.0 if self.min_p is None else self.min_p,
                       repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty)


class PenaltyBook:
    """The token ids one sequence's penalties touch, each once, with its count in the output: the
    prompt's and the output's under a repetition penalty, else the output's only. Penalties are
    applied to these ids alone (a gather and a scatter), never over the whole vocabulary; the
    arrays grow in place as tokens are recorded, so a step reads them without rebuilding."""

    def __init__(self) -> None:
        self._ids = np.empty(64, dtype=np.int64)
        self._counts = np.empty(64, dtype=np.float32)  # occurrences in the output (0: prompt only)
        self._where: dict[int, int] = {}  # token id → its position in the arrays
        self.size = 0

    @property
    def ids(self) -> np.ndarray:
        return self._ids[: self.size]  # [n] int64

    @property
    def counts(self) -> np.ndarray:
        return self._counts[: self.size]  # [n] fp32

    def add(self, token_id: int, count: float) -> None:
        pos = self._where.get(token_id)
        if pos is not None:
            self._counts[pos] += count
            return
        if self.size == len(self._ids):
            self._ids = np.concatenate([self._ids, np.empty_like(self._ids)])
            self._counts = np.concatenate([self._counts, np.empty_like(self._counts)])
        self._where[token_id] = self.size
        self._ids[self.size] = token_id
        self._counts[self.size] = count
        self.size += 1


@dataclass
class SamplerState:
    """One sequence's sampler state: its prompt, the tokens sampled so far and its penalty book.

    ``output_ids[t]`` is token ``t``; the next token is drawn with the generator of step
    ``len(output_ids)``. The book is built on first use from the ids, then kept up to date as
    tokens are recorded.
    """

    params: SamplingParams
    prompt_ids: Sequence[int] = ()
    output_ids: list[int] = field(default_factory=list)
    min_tokens_mask_ids: tuple[int, ...] = ()  # masked while len(output_ids) < min_tokens
    _book: PenaltyBook | None = None
    grammar: GrammarMatcher | None = None  # with ``params.grammar``: where the output stands in it

    @classmethod
    def new(cls, params: SamplingParams, prompt_ids: Sequence[int] = (), output_ids: Sequence[int] = (),
            eos_ids: Sequence[int] = (), vocab: GrammarVocab | None = None) -> SamplerState:
        """``output_ids``: tokens already sampled elsewhere (token 0 on a prefill replica).
        ``vocab``: the model's grammar vocabulary, needed when ``params.grammar`` is set; raises
        `GrammarError` when the grammar does not compile or rejects ``output_ids``."""
        stops = tuple(params.stop_token_ids) + (() if params.ignore_eos else tuple(eos_ids))
        matcher = None
        if params.grammar is not None:
            if vocab is None:
                raise GrammarError("a request with a grammar needs the model's grammar vocabulary")
            matcher = GrammarMatcher(compile_grammar(vocab, params.grammar), list(output_ids))
            if matcher.error is not None:
                raise GrammarError(matcher.error)
        return cls(params, prompt_ids, list(output_ids), tuple(dict.fromkeys(stops)), grammar=matcher)

    @property
    def step(self) -> int:
        return len(self.output_ids)

    def generator(self) -> torch.Generator | None:
        """The host generator of this step's draw: seeded from ``(seed, step)``; None unseeded."""
        if self.params.seed is None or self.params.greedy:
            return None
        gen = torch.Generator()
        gen.manual_seed((self.params.seed * 1_000_003 + self.step) & 0x7FFF_FFFF_FFFF_FFFF)
        return gen

    def book(self, vocab: int) -> PenaltyBook:
        """The penalty book (ids past ``vocab``, the logits' width, have no logit and are left out)."""
        if self._book is None:
            book = PenaltyBook()
            if self.params.repetition_penalty != 1.0:
                for tid in self.prompt_ids:
                    if tid < vocab:
                        book.add(tid, 0.0)
            for tid in self.output_ids:
                if tid < vocab:
                    book.add(tid, 1.0)
            self._book = book
        return self._book

    def record(self, token_id: int) -> None:
        self.output_ids.append(token_id)
        if self._book is not None:
            self._book.add(token_id, 1.0)
        if self.grammar is not None:
            self.grammar.advance(token_id)


def _top(raw: torch.Tensor, lse: torch.Tensor, states: Sequence[SamplerState]) -> list[TopLogprobs]:
    """raw: [B, V] unmodified logits, lse: [B] their logsumexp → each row's most likely tokens."""
    ks = [st.params.top_logprobs for st in states]
    if not any(ks):
        return [() for _ in states]
    vals, idx = torch.topk(raw, max(ks), dim=-1)  # [B, kmax]
    lps, ids = (vals - lse.unsqueeze(1)).tolist(), idx.tolist()
    return [tuple(zip(ids[i][:k], lps[i][:k], strict=True)) for i, k in enumerate(ks)]


def sample(logits: torch.Tensor, states: list[SamplerState], on_device: bool | None = None) -> Sampled:
    """logits: [B, V], one row per state → the chosen tokens, their log-probs and the top alternatives.

    Records each chosen token in its state. Logits off the CPU are sampled where they are
    (`engine.sampling.device`: batched torch ops, one copy back), CPU logits by numpy;
    ``on_device`` picks the path instead (True: the device path on CPU logits too, as tests run it).
    """
    if on_device is None:
        on_device = logits.device.type != "cpu"
    out = device.choose(logits, states) if on_device else _on_host(logits, states)
    for st, tok in zip(states, out.token_ids, strict=True):
        st.record(tok)
    return out


def _on_host(logits: torch.Tensor, states: list[SamplerState]) -> Sampled:
    """The pipeline with its cut and draw in numpy (engine/sampling/draw.py); records nothing."""
    raw = logits.float()  # [B, V]
    params = [st.params for st in states]
    x = raw
    if any(p.logit_bias or st.step < p.min_tokens for p, st in zip(params, states, strict=True)):
        x = bias_and_min_tokens(x, states)
    if any(st.grammar is not None for st in states):
        x = mask_logits(x, [st.grammar for st in states])
    if any(p.repetition_penalty != 1.0 or p.counts_output for p in params):
        x = penalties(x, states)
    hot = [i for i, p in enumerate(params) if not p.greedy]
    ids = argmax(x) if len(hot) < len(states) else np.empty(len(states), dtype=np.int64)  # [B]
    if hot:
        a = host(x if len(hot) == len(states) else x[hot])  # [b, V]
        sub = [params[i] for i in hot]
        cut = truncate(a, sub)  # [b]: temperature, min-p, top-k, top-p
        temps = np.array([p.temperature for p in sub])
        ids[hot] = draw(a, cut, temps, uniforms([states[i] for i in hot]))
    chosen_ids = torch.from_numpy(ids).to(raw.device)
    lse = raw.logsumexp(dim=-1)  # [B]
    chosen = raw.gather(1, chosen_ids.unsqueeze(1)).squeeze(1) - lse  # [B]
    return Sampled(ids.tolist(), chosen.tolist(), _top(raw, lse, states))
