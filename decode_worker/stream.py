"""One choice's state inside a decode worker: its pending events, sampler and generated tokens.

Invariants: events are pushed only from the worker's event loop; ``close`` is called exactly once
and pushes the stream's final event (the one with a ``finish_reason``). ``next_event`` hands the
consumer everything pushed since its last call as one event (tokens in order, the final event's
finish reason and timings), so a consumer that falls behind the step loop catches up in one item
instead of one per token; a token-less final event (abort, error) is never merged into tokens.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from decode_worker.types import DecodeRequest, DecodeTimings, TokenEvent, merge_events
from engine.sampling.prompt_logprobs import PromptLogprobs
from engine.sampling.sampler import SamplerState, TopLogprobs


@dataclass(eq=False)
class Stream:
    req: DecodeRequest
    sampler: SamplerState  # with this choice's seed (`engine.sampling.choices`)
    index: int = 0  # the choice
    pending: deque[TokenEvent] = field(default_factory=deque)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    generated: list[int] = field(default_factory=list)  # token 0 included
    next_token: int | None = None  # fed at the next decode step (its KV is not cached yet)
    prefilled: int = 0  # colocated: prompt tokens whose KV is written
    pull_task: asyncio.Task[None] | None = None
    aborted: bool = False
    closed: bool = False
    enqueued: float = field(default_factory=time.monotonic)
    admitted_at: float | None = None
    decode_started: float | None = None
    transfer_s: float = 0.0
    transfer_bytes: int = 0
    prefill_s: float = 0.0
    prompt_scores: PromptLogprobs | None = None  # colocated: the prompt's log-probs so far, when asked

    @property
    def request_id(self) -> str:
        return self.req.request_id

    @property
    def seq_id(self) -> str:
        """Its sequence in the scheduler: one per choice of a request, whatever ``n`` is."""
        return f"{self.req.request_id}#{self.index}"

    def timings(self) -> DecodeTimings:
        now = time.monotonic()
        return DecodeTimings(
            queue_s=(self.admitted_at or now) - self.enqueued,
            transfer_s=self.transfer_s,
            transfer_bytes=self.transfer_bytes,
            prefill_s=self.prefill_s,
            decode_s=now - self.decode_started if self.decode_started else 0.0,
        )

    def _put(self, ev: TokenEvent) -> None:
        self.pending.append(ev)
        self.ready.set()

    async def next_event(self) -> TokenEvent:
        """Wait for an event, then return it merged with every token event queued behind it."""
        while not self.pending:
            self.ready.clear()
            await self.ready.wait()
        return self.take()

    def take(self) -> TokenEvent:
        """The first pending event merged with every token event queued behind it (some must be pending).

        ``ready`` may be shared by a request's choices (`decode_worker.choices.ChoiceGroup`)."""
        taken = [self.pending.popleft()]
        while self.pending and taken[-1].finish_reason is None and taken[-1].token_ids and self.pending[0].token_ids:
            taken.append(self.pending.popleft())
        return taken[0] if len(taken) == 1 else merge_events(taken)

    def accept(self, token_id: int, logprob: float, top: TopLogprobs, prompt_logprobs: PromptLogprobs | None,
               eos_ids: Sequence[int]) -> str | None:
        """A sampled token the grammar (if any) accepted: record it as the one fed next and push its
        event; returns the finish reason it sets (an EOS or stop id or a complete grammar: "stop";
        ``max_tokens`` reached: "length"), None while the stream goes on."""
        if self.decode_started is None:
            self.decode_started = time.monotonic()
        self.generated.append(token_id)  # disaggregated streams start with token 0 from the prefill
        self.next_token = token_id
        params, grammar = self.req.sampling, self.sampler.grammar
        reason = None
        if params.is_stop(token_id, eos_ids) or (grammar is not None and grammar.done):
            reason = "stop"
        elif len(self.generated) >= params.max_tokens:
            reason = "length"
        self.push(token_id, logprob, reason, top, prompt_logprobs)
        return reason

    def push(self, token_id: int, logprob: float, finish_reason: str | None = None,
             top: TopLogprobs = (), prompt_logprobs: PromptLogprobs | None = None) -> None:
        """Emit one token (token 0 with the prompt's log-probs, when asked); with a ``finish_reason``
        it is the final event."""
        if self.closed:
            return
        lps = (logprob,) if self.req.sampling.logprobs else None
        tops = (top,) if self.req.sampling.logprobs and self.req.sampling.top_logprobs else None
        if finish_reason is not None:
            self.closed = True
        self._put(
            TokenEvent(
                request_id=self.request_id,
                token_ids=(token_id,),
                index=self.index,
                logprobs=lps,
                top_logprobs=tops,
                finish_reason=finish_reason,
                timings=self.timings() if finish_reason else None,
                prompt_logprobs=prompt_logprobs,
            )
        )

    def close(self, finish_reason: str, error: str | None = None, error_code: str | None = None) -> None:
        """End the stream with no further token (abort or error)."""
        if self.closed:
            return
        self.closed = True
        self._put(
            TokenEvent(
                request_id=self.request_id,
                token_ids=(),
                index=self.index,
                finish_reason=finish_reason,
                error=error,
                error_code=error_code,
                timings=self.timings(),
            )
        )
