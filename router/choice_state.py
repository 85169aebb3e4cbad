"""What the router follows of one request and of each of its choices while it streams.

Owns: `GenerationInput` (a tokenized, validated request), `Delta` (what one step of a choice
releases: text, the tokens behind it, their log-probs, at the end its finish reason),
`ChoiceState` (one choice's detokenizer, stop strings, token count, the tokens sent, its moves and
finish; `ChoiceState.advance` accounts for new tokens) and `RequestState` (every choice, and when
the first and last tokens went out).

Invariants: a choice's tokens go through `ChoiceState.advance` exactly once each, in order, whichever
decode call brought them (`router.migration`), so ``sent`` is what the client has and ``num_tokens``
counts every token once; the first token that ends a choice (a stop string, a stop id, the
``max_tokens`` bound, or the pool's finish) is its last.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.sampling.prompt_logprobs import PromptLogprobs
from engine.sampling.sampler import SamplingParams, TopLogprobs
from router.codec import Detokenizer
from router.request_objective import RequestObjective
from router.stops import StopMatcher


@dataclass(frozen=True)
class GenerationInput:
    """A tokenized, validated request, as `router.generation.Generation` streams it."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    stop_strings: tuple[str, ...] = ()
    include_stop_str: bool = False  # the matched stop string, or the stop token's text, ends the text
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = None  # the prompt's log-probs, this many alternatives each (None: not asked)
    arrival_time: float = field(default_factory=time.time)  # wall clock, for worker queue metrics
    arrival_mono: float = field(default_factory=time.perf_counter)  # for our latency metrics
    n: int = 1  # choices (`engine.sampling.choices.MAX_CHOICES` at most, bounded by the request model)
    objective: RequestObjective | None = None  # class and TTFT deadline (`router.request_objective`); None: none


@dataclass(frozen=True)
class Delta:
    """What one event of one choice releases to the client."""

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[float | None, ...]
    finish_reason: str | None = None
    top_logprobs: tuple[TopLogprobs, ...] = ()  # one per token when the request asks, else empty
    cached_tokens: int = 0  # on token 0's delta: prompt tokens the prefill took from its prefix cache
    prompt_logprobs: PromptLogprobs | None = None  # on token 0's delta (choice 0's), when the request asks
    index: int = 0  # the choice


@dataclass
class ChoiceState:
    """One choice as the router follows it."""

    detok: Detokenizer
    stops: StopMatcher
    num_tokens: int = 0
    sent: list[int] = field(default_factory=list)  # every token sent (token 0 first): what a continuation carries
    moves: int = 0  # times its decode stream was lost and continued elsewhere (`router.migration`)
    finish_reason: str | None = None
    last_sent: float | None = None  # for its inter-token latency

    def advance(
        self,
        inp: GenerationInput,
        stop_ids: frozenset[int],
        token_ids: Sequence[int],
        logprobs: Sequence[float | None],
        tops: Sequence[TopLogprobs],
        finish_reason: str | None,
    ) -> Delta:
        """Account for a choice's new tokens; returns the text they release and, if they end it, why."""
        detok, stops = self.detok, self.stops
        text: list[str] = []
        kept_ids: list[int] = []
        kept_lps: list[float | None] = []
        kept_tops: list[TopLogprobs] = []
        for i, tid in enumerate(token_ids):
            self.num_tokens += 1
            self.sent.append(tid)
            kept_ids.append(tid)
            kept_lps.append(logprobs[i] if i < len(logprobs) else None)
            kept_tops.append(tops[i] if i < len(tops) else ())
            piece = detok.push(tid) if inp.include_stop_str or tid not in stop_ids else ""
            text.append(stops.feed(piece, armed=self.num_tokens > inp.sampling.min_tokens))
            if stops.finished:
                self.finish_reason = "stop"
                break
            if tid in stop_ids:
                self.finish_reason = "stop"
                break
            if self.num_tokens >= inp.sampling.max_tokens:
                self.finish_reason = "length"
                break
        if self.finish_reason is None and finish_reason is not None:
            self.finish_reason = finish_reason
        if self.finish_reason is not None and not stops.finished:
            text.append(stops.feed(detok.flush()))
            text.append(stops.flush())
        top = tuple(kept_tops) if inp.sampling.top_logprobs else ()
        return Delta("".join(text), tuple(kept_ids), tuple(kept_lps), self.finish_reason, top)


@dataclass
class RequestState:
    """A request as the router follows it: its choices, by index."""

    choices: list[ChoiceState]
    first_sent: float | None = None
    last_sent: float | None = None
    timed: bool = False  # the decode side's timings are recorded (once per request, not per choice)

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.choices)
