"""`DecodeWorker`: continuous batching over the paged KV cache, one token per sequence per step.

Life cycle of a request (the queues are `decode_worker.scheduler.DecodeScheduler`'s):

1. ``generate(req)`` compiles the request's grammar (off the event loop), checks length and queue
   bound, creates a `Stream` (its sampler state: the matcher rebuilt from token 0) and adds the
   sequence to **waiting**. It then relays the stream's events to the caller until the final one.
2. The step loop calls ``schedule()``. An admitted sequence has blocks reserved for its prompt KV
   plus the next token and moves to **transferring**: a request with a KV handle has a pull task
   import the KV from the prefill replica's outbox (`KVImporter`); one without (colocated, or the
   router's LOCAL path in a disaggregated cluster: ``DecodeWorkerConfig.local_prefill``) is
   prefilled here, whole or ``prefill_chunk_size`` tokens per step, between decode steps
   (`decode_worker.local_prefill`; scoring the prompt's log-probs chunk by chunk when the request
   asks; token 0's event carries them).
3. When the KV is in, the sequence is **running**: every step runs one batched decode over all
   running sequences (the first step feeds token 0), samples, and pushes each new token to its
   stream. Blocks are appended at block boundaries; when they run out the scheduler swaps the
   youngest sequence out to host memory (**swapped**, `HostSwapSpace`) and back in later — the decode
   pool never recomputes, so in disaggregated mode it prefills only the LOCAL requests it is sent.
4. A stream ends on EOS (unless ``ignore_eos``), a stop id, a complete grammar, ``max_tokens``, an
   error (a token the request's grammar rejects is one, never emitted), or abort:
   the caller closing the stream frees its blocks before the next step (a transfer in flight is
   allowed to finish first, so nothing is ever written into blocks someone else owns).

A continuation (a request moved here from a decode replica that went away, `DecodeChoice.decoded`)
is an ordinary request whose KV covers the prompt and the tokens sent but the last: pulled like a
prompt's, or prefilled here (without a handle), after which it samples nothing (its next token was sent) and
runs, feeding the last sent token first.

Choices (`DecodeRequest.choices`, one or more): one stream each, with sequence id
``{request_id}#{index}``, as a `decode_worker.choices.ChoiceGroup` whose head takes the prompt's KV
and whose forks (any further choices) share it (`decode_worker.scheduler`); the worker
makes their copies of a shared partial block when the KV is in and (prefilled here) samples each one's token 0.

Invariants: the scheduler, pool and streams are touched only on the event loop, except the sampler
states of a step's rows, which only that step's model-thread call reads and records into; the model
runs on the engine's `ModelThread`, one forward at a time, and the step's sampling with it (one
`sample` call), so nothing on the event loop waits on the device; each stream gets exactly one final event; ending the
head of a group before its KV is in ends every stream of the group.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import torch

from decode_worker.choices import ChoiceGroup
from decode_worker.config import DecodeWorkerConfig
from decode_worker.importer import KVImporter
from decode_worker.local_prefill import LocalPrefill
from decode_worker.scheduler import DecodeScheduler, SchedulerConfig, SchedulerOutput, SeqStatus
from decode_worker.step_budget import StepBudget
from decode_worker.stream import Stream
from decode_worker.swap_space import HostSwapSpace
from decode_worker.types import KV_LOST, DecodeRequest, TokenEvent
from engine.engine import Engine
from engine.errors import QueueFullError
from engine.load_report import LoadReport
from engine.runner import DecodeSeq, PrefillChunk
from engine.sampling.grammar import GrammarVocab, load_grammar
from engine.sampling.prompt_logprobs import PromptLogprobs, ScoreAsk, check_prompt_logprobs, chunk_ask
from engine.sampling.sampler import Sampled, SamplerState, TopLogprobs, sample
from engine.step_loop import StepLoop

log = logging.getLogger(__name__)


class DecodeWorker:
    def __init__(
        self,
        engine: Engine,
        config: DecodeWorkerConfig,
        importer: KVImporter | None = None,
        eos_token_ids: Sequence[int] = (),
        replica_id: str = "decode",
    ) -> None:
        self.colocated = config.mode == "colocated"
        # whether requests without a KV handle are prefilled here: always colocated; disaggregated,
        # only where the router may send them (`router.prefill_path: auto`)
        self.local_prefill = self.colocated or config.local_prefill
        if not self.colocated and importer is None:
            raise ValueError("a disaggregated decode worker needs a KV importer")
        self.engine = engine
        self.config = config
        self.importer = importer
        self.eos_ids = tuple(eos_token_ids)
        self.replica_id = replica_id
        self.scheduler = DecodeScheduler(
            SchedulerConfig(
                max_num_seqs=engine.config.max_num_seqs,
                watermark_blocks=config.watermark_blocks,
                max_swap_blocks=config.max_swap_blocks,
                share_prompt=engine.model_config.rope_recompute_position is None,  # see SchedulerConfig
            ),
            engine.pool,
        )
        self.streams: dict[str, Stream] = {}  # by sequence id
        self.groups: dict[str, ChoiceGroup] = {}  # by request id, while any of its streams is live
        self.prefilling = LocalPrefill(config.prefill_chunk_size)  # admitted, KV still computed here
        # the step-time fit of this replica's measured steps and, disaggregated, each step's LOCAL budget
        self.budget = StepBudget(config.prefill_chunk_size, config.tpot_safety)
        # swapped-out KV waits in host memory allocated here, once (pinned on CUDA): `HostSwapSpace`
        self.swap_space = HostSwapSpace(engine.cache, config.max_swap_blocks)
        log.info("swap space: %d blocks, %.1f GiB of %s host memory", config.max_swap_blocks,
                 self.swap_space.nbytes / 2**30, "pinned" if self.swap_space.buffer.is_pinned() else "plain")
        self._loop = StepLoop(f"{replica_id}-step-loop", self._step, self._fail_streams)
        self._background: set[asyncio.Future[None]] = set()
        self.num_steps = 0
        self.step_seconds = 0.0  # inside the model thread's forwards, summed over steps
        self.step_sequences = 0
        self.step_cpu_seconds = 0.0  # CPU time of the model thread in those steps (forwards and sampling)
        self.num_finished = 0
        self.num_swapped_out = 0

    # -- public API ---------------------------------------------------------------------------

    async def start(self) -> None:
        await self._loop.start()

    async def stop(self) -> None:
        await self._loop.stop()
        for stream in list(self.streams.values()):
            self._end(stream, "error", "decode worker stopped")

    async def generate(self, req: DecodeRequest) -> AsyncIterator[TokenEvent]:
        """Every choice's events, tagged with its index: each choice's first at once, then
        ``stream_interval`` tokens per event (fewer when the consumer catches up with the end); a
        token-less end follows the tokens before it (`decode_worker.choices.Relay`)."""
        vocab = await load_grammar(req.sampling.grammar, self.engine.model_dir, self.eos_ids)
        group = self._admit(req, vocab)
        wait = self.config.token_timeout_s
        try:
            async for ev in group.relay(self.config.stream_interval, wait,
                                        lambda st: self._end(st, "error", f"no token within {wait:.0f} s")):
                yield ev
        finally:
            for st in group.streams:
                if not st.closed or st.seq_id in self.streams:
                    self._abort(st)

    def load_report(self) -> LoadReport:
        s = self.scheduler
        pool = self.engine.pool
        return LoadReport(
            replica_id=self.replica_id,
            role="colocated" if self.colocated else "decode",
            num_waiting=s.num_waiting,
            num_running=s.num_running + s.num_transferring + s.num_swapped,
            outstanding_tokens=sum(
                len(st.req.prompt_token_ids) + len(st.generated) for st in self.streams.values()
            ),
            kv_blocks_free=pool.num_free_blocks,
            kv_blocks_total=pool.num_blocks,
            steps=self.num_steps,
            step_seconds=self.step_seconds,
            step_sequences=self.step_sequences,
            step_cpu_seconds=self.step_cpu_seconds,
            **self._path_load(),
        )

    def _path_load(self) -> dict[str, Any]:
        """What the router's path decision reads of this replica (`engine.load_report.LoadReport`): the
        running streams' context and tightest TPOT objective, the prompt tokens still to prefill here
        (admitted, and waiting without a KV handle), the step fit's coefficients."""
        context, tpots, queued = 0, [], sum(self.prefilling.remaining())
        for st in self.streams.values():
            seq = self.scheduler.get(st.seq_id)
            if seq is None:
                continue
            if seq.status is SeqStatus.RUNNING:
                context += seq.num_tokens
                if st.req.tpot_s is not None:
                    tpots.append(st.req.tpot_s)
            elif seq.status is SeqStatus.WAITING and st.req.handle is None and st.index == st.req.choices[0].index:
                queued += len(st.req.kv_token_ids)
        fit = self.budget.fit.model()
        return {"running_context_tokens": context, "running_tpot_s": min(tpots, default=None),
                "local_queue_tokens": queued,
                "step_fit": None if fit is None else (fit.base_s, fit.per_seq_s, fit.per_context_token_s,
                                                      fit.per_prefill_token_s)}

    def is_idle(self) -> bool:
        return not self.streams and not self.scheduler.has_work()

    # -- admission and abort ------------------------------------------------------------------

    def _admit(self, req: DecodeRequest, vocab: GrammarVocab | None = None) -> ChoiceGroup:
        n_prompt = len(req.prompt_token_ids)
        n_kv = len(req.kv_token_ids)  # a continuation's KV holds the tokens sent but the last, too
        local = req.handle is None  # prefilled here (colocated, or a LOCAL request of a disaggregated cluster)
        if self.colocated and not local:
            raise ValueError("colocated decode takes requests without a KV handle")
        if local and not self.local_prefill:
            raise ValueError("disaggregated decode needs a KV handle (prefill first): this replica prefills "
                             "no request itself (decode_worker local_prefill is off: router.prefill_path 'remote')")
        self.engine.check_length(n_prompt, req.sampling.max_tokens)
        if req.prompt_logprobs is not None and not local:
            raise ValueError("prompt log-probs are computed where the prompt is prefilled: a request whose KV "
                             "is pulled takes them from the prefill pool")
        check_prompt_logprobs(req.prompt_logprobs)
        if req.request_id in self.groups:
            raise ValueError(f"request id {req.request_id!r} is already streaming")
        if self._queued_beyond_free_slots() >= self.config.max_queue:
            raise QueueFullError(f"decode queue is full ({self.config.max_queue} waiting)", 1.0)
        if not local and any(c.first_token_id is None for c in req.choices):
            raise ValueError("each choice needs its token 0 from the prefill (a request with a KV handle)")
        if local and len(req.choices) > 1 and any(c.first_token_id is not None for c in req.choices):
            raise ValueError("prefilled here, choices carry no token 0 (a continuation, which does, is one "
                             "choice alone)")
        if req.prompt_logprobs is not None and req.choices[0].first_token_id is not None:
            raise ValueError("a continuation takes no prompt log-probs (token 0 carried them)")
        if req.handle is not None and req.handle.n_tokens != n_kv:
            raise ValueError(f"the KV handle holds {req.handle.n_tokens} tokens; this request needs {n_kv}")
        if (sent := len(req.choices[0].generated)) >= req.sampling.max_tokens:
            raise ValueError(f"{sent} tokens sent leave nothing of max_tokens={req.sampling.max_tokens} to decode")
        group = ChoiceGroup.new(req, self.eos_ids, vocab)  # a grammar rejecting a sent token raises here
        forks = [st.seq_id for st in group.streams[1:]]
        self.scheduler.add(group.head.seq_id, n_kv, arrival=group.head.enqueued, forks=forks)
        self.groups[req.request_id] = group
        self.streams.update((st.seq_id, st) for st in group.streams)
        self._loop.wake()
        return group

    def _queued_beyond_free_slots(self) -> int:
        """Waiting sequences that the next ``schedule()`` cannot admit for want of a batch slot.

        Requests that arrive together all sit in ``waiting`` until the step loop runs; those that
        free slots will take are not queued, so they do not count against ``max_queue``.
        """
        s = self.scheduler
        live = s.num_running + s.num_transferring + s.num_swapped
        return s.num_waiting - max(0, self.engine.config.max_num_seqs - live)

    def _abort(self, stream: Stream) -> None:
        """The caller went away: free now, or as soon as a transfer into the blocks has finished."""
        stream.aborted = True
        seq = self.scheduler.get(stream.seq_id)
        group = self.groups.get(stream.request_id)
        pulling = group is not None and group.pull_task is not None
        if seq is not None and seq.status is SeqStatus.TRANSFERRING and pulling:
            return  # the pull task sees `aborted` and finishes the sequence
        head = group is not None and group.head is stream
        if seq is not None and seq.status is SeqStatus.WAITING and stream.req.handle is not None and head:
            task = asyncio.ensure_future(self._release(stream))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
        self._end(stream, "abort")

    async def _release(self, stream: Stream) -> None:
        assert self.importer is not None and stream.req.handle is not None
        try:
            await self.importer.release(stream.req.handle)
        except Exception as e:  # the lease frees the blocks anyway
            log.warning("release of %s failed: %s", stream.request_id, e)

    def _end(self, stream: Stream, reason: str, error: str | None = None, code: str | None = None) -> None:
        """Finish a stream without a new token; frees its blocks and forgets it. A group's head
        before its KV is in takes the group's other streams with it (their forks end with it)."""
        stream.close(reason, error, code)
        for other in filter(None, map(self.streams.get, self._forget(stream)[1:])):
            other.close(reason, error, code)
            self._forget(other)

    def _forget(self, stream: Stream) -> list[str]:
        """Drop a stream (its sequence freed); returns the sequences the scheduler finished."""
        finished = self.scheduler.finish(stream.seq_id)
        self.swap_space.release(stream.seq_id)
        group = self.groups.get(stream.request_id)
        if group is not None and group.head is stream:
            self.prefilling.discard(group)
        if self.streams.pop(stream.seq_id, None) is not None:
            self.num_finished += 1
        if group is not None and not any(st.seq_id in self.streams for st in group.streams):
            del self.groups[stream.request_id]
        return finished

    # -- step loop ------------------------------------------------------------------------------

    def _fail_streams(self, e: Exception) -> None:
        for st in list(self.streams.values()):
            self._end(st, "error", f"decode worker error: {e}")

    async def _step(self) -> None:
        out = self.scheduler.schedule()
        self._execute_swaps_and_admissions(out)
        decode = [self.streams[s.seq_id] for s in out.decode if s.seq_id in self.streams]
        budget = self._local_budget(decode) if self.prefilling and not self.colocated else None
        chunks, prefill_groups = self.prefilling.plan(self.scheduler, budget)
        prefill_streams = [g.head for g in prefill_groups]
        if not decode and not chunks:
            await self._loop.idle(1.0)
            return
        seqs = [self._decode_seq(st) for st in decode]
        asks = [chunk_ask(st.req.prompt_token_ids, c.start_pos, len(c.token_ids), st.req.prompt_logprobs)
                for st, c in zip(prefill_streams, chunks, strict=True)]
        ending = self.prefilling.ending(prefill_groups, chunks)  # token 0 of each of their choices
        try:  # the forward and the sampling, off the event loop: the loop never waits on the device
            t0 = time.monotonic()
            sampled, scored = await self.engine.model_thread.run(self._forward, seqs, chunks, asks,
                                                                 [st.sampler for st in decode], ending)
            dt = time.monotonic() - t0
        except Exception as e:
            log.exception("decode step failed")
            for st in decode + prefill_streams:
                self._end(st, "error", f"model step failed: {e}")
            return
        self.num_steps += 1
        self.step_seconds += dt
        self.step_sequences += len(seqs)
        self.budget.record(len(seqs), sum(q.position for q in seqs), sum(len(c.token_ids) for c in chunks), dt)
        if decode:
            self._after_decode(decode, sampled.rows(0, len(decode)))
        if chunks:
            firsts, at = {}, len(decode)
            for row, states in ending:
                firsts[row] = sampled.rows(at, at + len(states))
                at += len(states)
            self._after_prefill(prefill_groups, chunks, firsts, scored, dt)

    def _local_budget(self, decode: list[Stream]) -> int:
        """This step's LOCAL prefill tokens (disaggregated): `StepBudget.tokens` of the streams it decodes."""
        seqs = [self.scheduler.get(st.seq_id) for st in decode]
        context = sum(seq.num_tokens for seq in seqs if seq is not None)
        tpot = min((st.req.tpot_s for st in decode if st.req.tpot_s is not None), default=None)
        return self.budget.tokens(len(decode), context, tpot, sum(self.prefilling.remaining()))

    def _forward(
        self, seqs: list[DecodeSeq], chunks: list[PrefillChunk], asks: list[ScoreAsk | None],
        decode: list[SamplerState], ending: list[tuple[int, list[SamplerState]]],
    ) -> tuple[Sampled, list[PromptLogprobs | None]]:
        """On the model thread: the decode and prefill forwards, then one `sample` call (the step's
        one wait on the device) over the decode rows (``decode``: their states) and, for each prefill
        row in ``ending`` (row, its choices' states), that row once per choice."""
        cpu0 = time.thread_time()
        runner = self.engine.runner
        rows = [runner.decode(seqs)] if seqs else []  # [B, V]
        scored: list[PromptLogprobs | None] = []
        if chunks:
            pre, scored = runner.prefill_scored(chunks, asks)  # [len(chunks), V]
            rows += [pre[row : row + 1].expand(len(states), -1) for row, states in ending]  # [n, V] each
        states = decode + [s for _, group in ending for s in group]
        x = rows[0].contiguous() if len(rows) == 1 else torch.cat(rows) if rows else None  # [rows, V]
        out = sample(x, states) if x is not None else Sampled([], [], [])
        self.step_cpu_seconds += time.thread_time() - cpu0  # < the step's wall time by its waits (GIL, cores)
        return out, scored

    def _decode_seq(self, st: Stream) -> DecodeSeq:
        seq = self.scheduler.get(st.seq_id)
        assert seq is not None and st.next_token is not None
        if st.decode_started is None:
            st.decode_started = time.monotonic()
        history = None  # the tokens before this one, where the step recomputes the sequence (Phi-3 longrope)
        if seq.num_tokens == self.engine.model_config.rope_recompute_position:
            history = (*st.req.prompt_token_ids, *st.generated[:-1])
        return DecodeSeq(st.next_token, seq.num_tokens, seq.block_ids, history)

    def _execute_swaps_and_admissions(self, out: SchedulerOutput) -> None:
        cache = self.engine.cache
        for seq, blocks in out.swap_out:  # first: these ids may already be reused below
            self.swap_space.swap_out(seq.seq_id, cache, blocks)
            self.num_swapped_out += 1
        for seq, blocks in out.swap_in:
            self.swap_space.swap_in(seq.seq_id, cache, blocks)
        for seq in out.failed:
            st = self.streams.get(seq.seq_id)
            if st is not None:
                self._end(st, "error", "sequence outgrew the decode pool's KV blocks")
        for seq in out.admitted:
            group = self.groups[self.streams[seq.seq_id].request_id]
            for st in group.streams:
                st.admitted_at = time.monotonic()
            if group.req.handle is None:  # prefilled here: colocated, or LOCAL in a disaggregated cluster
                self.prefilling.add(group)
            else:
                group.pull_task = asyncio.create_task(self._pull(group, list(seq.block_ids)))

    async def _pull(self, group: ChoiceGroup, block_ids: list[int]) -> None:
        assert self.importer is not None and group.req.handle is not None
        head = group.head
        try:
            stats = await self.importer.pull(group.req.handle, self.engine.cache, block_ids)
        except Exception as e:
            log.warning("KV pull for %s failed: %s", head.request_id, e)
            self.scheduler.on_transfer_failed(head.seq_id)
            for st in group.streams:
                self._end(st, "error", f"KV transfer failed: {e}", KV_LOST)
            return
        finally:
            group.pull_task = None
            self._loop.wake()
        for st in group.streams:
            st.transfer_s, st.transfer_bytes = stats.seconds, stats.bytes
        group.kv_in(self.scheduler, self.engine.cache)
        for st in group.streams:
            if st.aborted and not st.closed:
                self._end(st, "abort")

    def _after_prefill(
        self, groups: list[ChoiceGroup], chunks: list[PrefillChunk], firsts: dict[int, Sampled],
        scored: list[PromptLogprobs | None], dt: float,
    ) -> None:
        """``firsts``: per row whose prompt the step completed, token 0 of each of its group's choices."""
        done = self.prefilling.advance(groups, chunks, scored, dt, lambda seq_id: seq_id in self.streams,
                                       self.scheduler, self.engine.cache)
        for row, group in done:
            if row not in firsts:
                continue  # a continuation: it feeds its last sent token at the next decode step
            # token 0 of every choice from the same logits row, each with its own sampler (seed);
            # the prompt's log-probs ride on the head's
            head = group.head
            for m, tok, lp, top in zip(group.streams, *firsts[row], strict=True):
                if m.seq_id in self.streams:
                    self._emit(m, tok, lp, top, head.prompt_scores if m is head else None)

    def _after_decode(self, streams: list[Stream], out: Sampled) -> None:
        for st, tok, lp, top in zip(streams, *out, strict=True):
            if st.seq_id not in self.streams:
                continue  # aborted while the step ran; its blocks are already free
            self.scheduler.on_token(st.seq_id)
            self._emit(st, tok, lp, top)

    def _emit(self, st: Stream, tok: int, lp: float, top: TopLogprobs = (),
              prompt_logprobs: PromptLogprobs | None = None) -> None:
        grammar = st.sampler.grammar
        if grammar is not None and grammar.error is not None:  # never emit a token the grammar rejected
            self._end(st, "error", grammar.error)
            return
        if st.decode_started is None:
            st.decode_started = time.monotonic()
        st.generated.append(tok)  # disaggregated streams start with token 0 from the prefill
        st.next_token = tok
        params = st.req.sampling
        reason = None
        if params.is_stop(tok, self.eos_ids) or (grammar is not None and grammar.done):
            reason = "stop"
        elif len(st.generated) >= params.max_tokens:
            reason = "length"
        st.push(tok, lp, reason, top, prompt_logprobs)
        if reason is not None:
            self._forget(st)
