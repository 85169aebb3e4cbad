"""One request's choices inside a decode worker: its streams, one per choice, relayed as one stream.

Owns: `ChoiceGroup` (a request's `Stream`s, head first, sharing one readiness event, the task
pulling the prompt's KV they share, and `ChoiceGroup.relay`, their events as one stream) and `Relay`
(the ``stream_interval`` batching of one choice's events).

A request with ``n`` choices is one group of ``n`` streams (a lone choice is a group of one): the
scheduler holds the head's sequence with the others as its forks (`decode_worker.scheduler`), so
the prompt's KV is pulled (or prefilled) once, into the head's blocks, and shared. The caller reads
one stream of `TokenEvent`s tagged with their choice's ``index``, each choice's events in order and
relayed as if it were alone: its first event at once, then ``stream_interval`` tokens an event
(fewer when the consumer catches up with the end); a token-less end follows the tokens before it.

Invariants: every stream of a group shares the group's ``ready`` event, which is set whenever one of
them has an event pending, so one wait serves them all; `ChoiceGroup.take` never waits and never
returns a stream with nothing pending.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from decode_worker.scheduler import DecodeScheduler
from decode_worker.stream import Stream
from decode_worker.types import DecodeRequest, TokenEvent, merge_events
from engine.kv_cache import KVCache
from engine.sampling.choices import choice_params
from engine.sampling.grammar import GrammarVocab
from engine.sampling.sampler import SamplerState


@dataclass(eq=False)
class ChoiceGroup:
    req: DecodeRequest
    streams: list[Stream]  # head first: the sequence the prompt's KV arrives into
    ready: asyncio.Event
    pull_task: asyncio.Task[None] | None = None  # disaggregated, while the prompt's KV comes in

    @classmethod
    def new(cls, req: DecodeRequest, eos_ids: Sequence[int], vocab: GrammarVocab | None = None) -> ChoiceGroup:
        """A stream per choice, each sampler with its choice's seed (`engine.sampling.choices`) and grammar
        matcher (``vocab``: the grammar's, when the request has one, replaying the tokens sent) and,
        when tokens were sent (token 0 from the prefill, or a continuation's), the last as its next
        token to feed."""
        ready = asyncio.Event()
        streams = []
        for c in req.choices:
            sent = c.generated  # token 0 from the prefill; a continuation's every token sent so far
            sampler = SamplerState.new(choice_params(req.sampling, c.index), req.prompt_token_ids, sent, eos_ids,
                                       vocab)
            st = Stream(req=req, sampler=sampler, index=c.index, ready=ready)
            if sent:
                st.generated.extend(sent)
                st.next_token = sent[-1]
            streams.append(st)
        return cls(req, streams, ready)

    @property
    def head(self) -> Stream:
        return self.streams[0]

    async def next_events(self) -> list[tuple[Stream, TokenEvent]]:
        """Wait until some stream has an event; take every stream's pending events (one merged
        event per stream, see `Stream.take`)."""
        while not any(st.pending for st in self.streams):
            self.ready.clear()
            await self.ready.wait()
        return [(st, st.take()) for st in self.streams if st.pending]

    def kv_in(self, scheduler: DecodeScheduler, cache: KVCache) -> None:
        """The prompt's KV is in the head's blocks: the group runs, each fork with its own copy of a
        shared partial block, made here, before any of them writes (`DecodeScheduler.on_transfer_done`)."""
        if copies := scheduler.on_transfer_done(self.head.seq_id):
            src, dst = zip(*copies, strict=True)
            cache.scatter_blocks(list(dst), cache.gather_blocks(list(src)))

    async def relay(self, interval: int, timeout_s: float, on_timeout: Callable[[Stream], None]
                    ) -> AsyncIterator[TokenEvent]:
        """Every choice's events as the caller gets them (a `Relay` each), until each choice's final
        one; ``on_timeout`` ends each open stream when none has an event within ``timeout_s``."""
        relays = {st.index: Relay(interval) for st in self.streams}
        while not all(r.done for r in relays.values()):
            try:
                taken = await asyncio.wait_for(self.next_events(), timeout_s)
            except asyncio.TimeoutError:
                for st in self.streams:
                    if not st.closed:
                        on_timeout(st)
                continue  # their final events are queued now
            for st, ev in taken:
                for out in relays[st.index].feed(ev):
                    yield out


@dataclass
class Relay:
    """One choice's events as the caller gets them (see the module docstring)."""

    interval: int
    held: TokenEvent | None = None  # tokens not yet sent, fewer than the interval
    sent: bool = False
    done: bool = False  # its final event went out

    def feed(self, ev: TokenEvent) -> list[TokenEvent]:
        """The events to send now for ``ev`` (none while fewer than ``interval`` tokens are held)."""
        out: list[TokenEvent] = []
        if self.held is not None:
            if ev.token_ids:
                ev = merge_events([self.held, ev])
            else:
                out.append(self.held)
            self.held = None
        if self.sent and ev.finish_reason is None and len(ev.token_ids) < self.interval:
            self.held = ev
            return out
        out.append(ev)
        self.sent = True
        self.done = ev.finish_reason is not None
        return out

