"""One request's generation as the router sees it: prefill, token 0 at once, the decode stream.

Owns: `Generation`, which turns a tokenized, validated request into a stream of `Delta`s (new text,
the tokens behind it, their log-probs, and at the end the finish reason) that the HTTP layer
formats as OpenAI chunks or one response. It applies incremental detokenization, stop strings and
the ``max_tokens`` bound, and records the request's metrics.

Life cycle: [REMOTE: disaggregated, the path chosen per request by `router.path_choice` under
``prefill_path: auto``, always under ``remote``] ``prefill`` → Delta(token 0) per choice →
``generate(choices with their token 0, handle)`` → Delta per event; [LOCAL: colocated, or chosen
per request] ``generate(choices, None)`` → Delta per event (each choice's first is its token 0,
prefilled on the decode replica).
The prompt's log-probs, when asked, come with token 0 (from the prefill, or on the LOCAL path with its
event) and ride on token 0's Delta. The path taken is what attainment is counted under.
A request finished by token 0 (EOS, ``max_tokens == 1``) never reaches the decode pool. If the
decode pool cannot pull the prompt's KV (``error_code == KV_LOST``: the prefill replica died after
answering, or the lease ran out in a queue) before any decode token, the prompt is prefilled once
more and the decode call resubmitted, keeping the token 0 already sent. A request that ends before
any decode replica answered for its handle (client gone after token 0, decode refused) has the
handle released (`Backends.release`) rather than left to its lease.

A decode stream lost mid-request (its replica died, or sent nothing for the token timeout:
`router.migration.DecodeLost`) is cancelled and each of its choices still going continues as a
decode call of its own, carrying the tokens sent (`router.lanes` reads the calls as one stream);
the client sees a pause. Past ``migration_limit`` moves of a choice the request fails.

Admission (`router.admission`) comes first: a replica at its bound of requests in flight refuses
with 429 before the prefill, so nothing it admits is later dropped for load.

Choices (``n > 1``): the prompt is prefilled once and token 0 sampled for every choice (each with
its own seed, `engine.sampling.choices`); one decode call runs the choices still going (the decode replica
forks the prompt's KV for them) and its events carry their choice's index. Each choice has its own
detokenizer, stop strings, bounds and finish reason; a Delta carries its choice's ``index``. A choice
ended here (stop string, our ``max_tokens`` bound) has its later events ignored; the decode call is
cancelled once every choice has ended.

Invariants: of each choice's Deltas exactly one carries a finish reason, and it is that choice's
last; the stream ends after every choice's last Delta; ``completion_tokens`` counts every generated
token of a choice up to and including the one that finished it (token 0 included, EOS included), as
OpenAI and vLLM count; the text of a stop token (EOS or a requested
stop id) is emitted only with ``include_stop_str_in_output``; stop strings are looked for once more
than ``min_tokens`` tokens are out (vLLM's rule; the sampler masks stop ids until ``min_tokens``); stopping early
(stop string, our own ``max_tokens`` bound, consumer gone) cancels the decode stream.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import AsyncGenerator

from decode_worker.types import KV_LOST, DecodeChoice, DecodeRequest, DecodeTimings, TokenEvent
from engine.sampling.prompt_logprobs import PromptLogprobs
from kv_transfer.handle import KVHandle
from prefill_worker.types import PrefillRequest
from router.admission import Admission
from router.backends import Backends
from router.choice_state import ChoiceState, Delta, GenerationInput, RequestState
from router.codec import TextCodec
from router.lanes import Lane, Lanes
from router.metrics import RouterMetrics
from router.migration import DecodeLost, continuation, continuation_id, continuation_prefill
from router.path_choice import PathChoice
from router.path_policy import Path
from router.request_objective import record_attainment
from router.stops import StopMatcher

__all__ = ["Delta", "Generation", "GenerationInput", "StreamError"]

logger = logging.getLogger("pdserve.router")

class StreamError(Exception):
    """The decode pool ended the stream with an error (or stopped answering)."""


class Generation:
    """Streams one request (see the module docstring)."""

    def __init__(self, backends: Backends, codec: TextCodec, metrics: RouterMetrics,
                 admission: Admission | None = None, migration_limit: int = 3,
                 path_choice: PathChoice | None = None) -> None:
        """``path_choice``: decides each request's path (disaggregated, ``prefill_path: auto``); None:
        disaggregated requests always take the REMOTE path."""
        self._backends = backends
        self._path_choice = path_choice
        self._migration_limit = migration_limit
        self._codec = codec
        self._metrics = metrics
        self._admission = admission or Admission(None)

    async def stream(self, inp: GenerationInput) -> AsyncGenerator[Delta, None]:
        st = RequestState([ChoiceState(self._codec.detokenizer(inp.skip_special_tokens),
                             StopMatcher(inp.stop_strings, inp.include_stop_str)) for _ in range(inp.n)])
        stop_ids = frozenset(inp.sampling.stop_token_ids)
        if not inp.sampling.ignore_eos:
            stop_ids |= frozenset(self._codec.eos_token_ids)
        self._admission.enter()  # 429 now, before any token, if this replica is at its bound
        lanes = Lanes(self._backends)
        path = Path.LOCAL
        try:
            path = self._path(inp)
            firsts: dict[int, int | None] = dict.fromkeys(range(inp.n))  # choice → token 0 (LOCAL: None)
            handle = None
            if path is Path.REMOTE:
                result = await self._backends.prefill(self._prefill_request(inp, scored=True))
                handle = result.handle
                self._metrics.queue.observe(result.timings.queue_s)
                self._metrics.prefill.observe(result.timings.prefill_s)
                for i, ft in enumerate(result.choices):
                    delta = st.choices[i].advance(inp, stop_ids, (ft.token_id,), (ft.logprob,),
                                          (ft.top_logprobs,), ft.finish_reason)
                    delta = dataclasses.replace(delta, cached_tokens=result.num_cached_tokens, index=i)
                    if i == 0:
                        delta = _with_prompt_logprobs(delta, inp, result.prompt_logprobs)
                    yield self._sent(st, delta)
                    firsts[i] = ft.token_id
                if st.finished:
                    if handle is not None:
                        self._backends.release(handle)
                    return
            rebuild = self._prefill_request(inp) if handle is not None else None
            lanes.start(Lane(self._decode_request(inp, st, firsts, handle), rebuild))
            while lanes:
                lane, ev = await lanes.next()
                if isinstance(ev, DecodeLost):
                    lanes.abandon(lane)
                    for new in await self._migrate(inp, st, lane, ev, path):
                        lanes.start(new)
                    continue
                if isinstance(ev, Exception):
                    raise ev
                if ev is None:
                    if any(st.choices[i].finish_reason is None for i in lane.indices):
                        raise StreamError("the decode stream ended without a finish reason")
                    continue
                lane.claimed = True  # the decode replica has it: it pulls, releases or requeues
                if ev.finish_reason == "error":
                    if ev.error_code == KV_LOST and lane.rebuild is not None and not lane.decoded:
                        lanes.stop(lane)
                        assert lane.handle is not None
                        self._backends.release(lane.handle)  # if its source still holds it (e.g. requeued)
                        lanes.start(await self._prefill_again(lane, ev.error or "KV lost"))
                        continue
                    raise StreamError(ev.error or "the decode pool failed this request")
                if ev.timings is not None and not st.timed:
                    st.timed = True
                    self._record_timings(ev.timings, path)
                choice = st.choices[ev.index]
                if choice.finish_reason is not None:
                    continue  # ended here (a stop string): the replica runs it until all end
                lane.decoded = lane.decoded or bool(ev.token_ids)
                delta = choice.advance(inp, stop_ids, ev.token_ids, _logprobs(ev),
                                      ev.top_logprobs or (), ev.finish_reason)
                delta = dataclasses.replace(delta, index=ev.index)
                if handle is None and st.first_sent is None:  # LOCAL: token 0's event
                    delta = _with_prompt_logprobs(delta, inp, ev.prompt_logprobs)
                yield self._sent(st, delta)
                if st.finished:
                    return
                if all(st.choices[i].finish_reason is not None for i in lane.indices):
                    lanes.stop(lane)  # its choices ended here (stop strings): it need run no further
            if not st.finished:
                raise StreamError("the decode stream ended without a finish reason")
        finally:
            lanes.close()  # client gone, decode refused or unreachable: streams cancelled, handles freed
            self._admission.leave()
            self._finish(st, inp, path)

    def _path(self, inp: GenerationInput) -> Path:
        """Where this request's prompt is prefilled: colocated LOCAL; disaggregated REMOTE, or as the
        path choice decides."""
        if not self._backends.disaggregated:
            return Path.LOCAL
        if self._path_choice is None:
            return Path.REMOTE
        cls = inp.objective.cls if inp.objective is not None else None
        return self._path_choice.choose(len(inp.prompt_token_ids), cls).path

    async def _migrate(self, inp: GenerationInput, st: RequestState, lane: Lane, lost: DecodeLost,
                       path: Path) -> list[Lane]:
        """``lane``'s decode replica went away: a continuation of each of its choices still going,
        each on its own (`router.migration`); a choice moved ``migration_limit`` times already fails
        the request. A continuation takes its request's path: REMOTE has the prefill pool rebuild its
        KV, LOCAL has the decode replica that takes it prefill it (no handle)."""
        live = [i for i in lane.indices if st.choices[i].finish_reason is None]
        moved = max((st.choices[i].moves for i in live), default=0)
        if moved >= self._migration_limit:
            raise StreamError(f"{lost} (the stream was moved {moved} times already; "
                              f"migration_limit is {self._migration_limit})")
        self._metrics.migrations.labels(reason=lost.reason).inc()
        logger.warning("decode stream of %s lost (%s: %s); continuing choices %s elsewhere",
                       inp.request_id, lost.reason, lost, live)
        out = []
        for i in live:
            st.choices[i].moves += 1
            sent = tuple(st.choices[i].sent)
            rid = continuation_id(inp.request_id, st.choices[i].moves, i)
            if not sent:  # LOCAL, before token 0: the choice as it was asked
                out.append(Lane(DecodeRequest(rid, inp.prompt_token_ids, inp.sampling, arrival_time=inp.arrival_time,
                                              choices=(DecodeChoice(i),), prompt_logprobs=inp.prompt_logprobs)))
                continue
            handle, rebuild = None, None
            if path is Path.REMOTE:
                rebuild = continuation_prefill(rid, inp.prompt_token_ids, sent, inp.arrival_time)
                handle = await self._kv_for(rebuild, str(lost))
            self._metrics.migrated_tokens.inc(len(inp.prompt_token_ids) + len(sent) - 1)
            out.append(Lane(continuation(rid, inp.prompt_token_ids, inp.sampling, i, sent, handle,
                                         inp.arrival_time), rebuild))
        return out

    @staticmethod
    def _prefill_request(inp: GenerationInput, scored: bool = False) -> PrefillRequest:
        """The prefill call (``scored``: with the prompt's log-probs, when the request asks)."""
        return PrefillRequest(request_id=inp.request_id, prompt_token_ids=inp.prompt_token_ids,
                              sampling=inp.sampling, arrival_time=inp.arrival_time, n=inp.n,
                              prompt_logprobs=inp.prompt_logprobs if scored else None,
                              ttft_deadline=inp.objective.ttft_deadline if inp.objective is not None else None)

    @staticmethod
    def _decode_request(inp: GenerationInput, st: RequestState, firsts: dict[int, int | None],
                        handle: KVHandle | None) -> DecodeRequest:
        """The decode call: the choices still going (at least one: a request every choice of which
        ended at token 0 never gets here), each with its token 0 (LOCAL: None)."""
        live = tuple(DecodeChoice(i, firsts[i]) for i, c in enumerate(st.choices) if c.finish_reason is None)
        goal = inp.objective
        return DecodeRequest(request_id=inp.request_id, prompt_token_ids=inp.prompt_token_ids,
                             sampling=inp.sampling, choices=live, handle=handle, arrival_time=inp.arrival_time,
                             prompt_logprobs=None if handle is not None else inp.prompt_logprobs,
                             ttft_deadline=goal.ttft_deadline if goal is not None else None,
                             tpot_s=goal.cls.tpot_s if goal is not None else None)

    async def _prefill_again(self, lane: Lane, why: str) -> Lane:
        """The decode pool could not pull the lane's KV (its prefill replica died after answering,
        or the lease ran out while the request queued): prefill it again, on whichever replica
        Serve picks, and resubmit with the new handle (once). The client already has every token
        sent, so the request keeps them whatever the new prefill samples; only its KV is used."""
        logger.warning("KV of %s was lost before decode (%s); prefilling again", lane.req.request_id, why)
        assert lane.rebuild is not None
        handle = await self._kv_for(lane.rebuild, why)
        return Lane(dataclasses.replace(lane.req, handle=handle))

    async def _kv_for(self, req: PrefillRequest, why: str) -> KVHandle:
        result = await self._backends.prefill(req)
        if result.handle is None:
            raise StreamError(f"the KV was lost ({why}) and could not be rebuilt")
        return result.handle

    def _sent(self, st: RequestState, delta: Delta) -> Delta:
        now = time.perf_counter()
        choice = st.choices[delta.index]
        if st.first_sent is None:
            st.first_sent = now
        if choice.last_sent is not None:
            self._metrics.itl.observe(now - choice.last_sent)  # the gap within one choice's stream
        choice.last_sent = st.last_sent = now
        return delta

    def _record_timings(self, t: DecodeTimings, path: Path) -> None:
        if path is Path.LOCAL:
            self._metrics.queue.observe(t.queue_s)
            self._metrics.prefill.observe(t.prefill_s)
        else:
            self._metrics.kv_transfer.observe(t.transfer_s)

    def _finish(self, st: RequestState, inp: GenerationInput, path: Path) -> None:
        """Per request: prompt tokens once, every choice's tokens, TPOT over the longest choice (the
        choices advance together, a token each per step); success counted per choice that finished."""
        m = self._metrics
        if st.first_sent is None:  # refused or failed before token 0: nothing was computed for it
            return
        m.prompt_tokens.inc(len(inp.prompt_token_ids))
        m.generation_tokens.inc(st.num_tokens)
        end = st.last_sent or st.first_sent
        ttft = st.first_sent - inp.arrival_mono
        m.ttft.observe(ttft)
        m.e2e.observe(end - inp.arrival_mono)
        longest = max(c.num_tokens for c in st.choices)
        if longest > 1:
            m.tpot.observe((end - st.first_sent) / (longest - 1))
        record_attainment(m, inp.objective, path, inp.arrival_mono, st.first_sent, end, longest)
        for c in st.choices:
            if c.finish_reason is not None:
                m.success.labels(finish_reason=c.finish_reason).inc()


def _with_prompt_logprobs(delta: Delta, inp: GenerationInput, scores: PromptLogprobs | None) -> Delta:
    """Token 0's delta with the prompt's log-probs the request asked for (a pool that did not
    compute them fails the request rather than answer without them)."""
    if inp.prompt_logprobs is None:
        return delta
    if scores is None or len(scores) != len(inp.prompt_token_ids) - 1:
        raise StreamError("the pool returned no prompt log-probs for this prompt")
    return dataclasses.replace(delta, prompt_logprobs=scores)


def _logprobs(ev: TokenEvent) -> tuple[float | None, ...]:
    return tuple(ev.logprobs) if ev.logprobs is not None else (None,) * len(ev.token_ids)

