"""What a request asks of the sampler and one sequence's sampling state.

Owns: `SamplingParams` (what a request asks for), `SamplingDefaults` (what a model asks for when the
request does not), `PenaltyBook` (the ids a sequence's penalties touch, with their output counts)
and `SamplerState` (one sequence's prompt, output, penalty book and grammar matcher). Both sampling
paths (`engine.sampling.sampler` on the host, `engine.sampling.device` on a device) read them.

Invariants: `SamplingParams` is frozen and validated at construction (an out-of-range field raises
naming it); a state's seeded generator for step t depends only on (seed, t).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.sampling.grammar import (
    GrammarError,
    GrammarMatcher,
    GrammarSpec,
    GrammarVocab,
    compile_grammar,
)

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
