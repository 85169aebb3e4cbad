"""`DecodeWorker`: continuous batching over the paged KV cache, one token per sequence per step.

Life cycle of a request (the queues are `decode_worker.scheduler.DecodeScheduler`'s):

1. ``generate(req)`` compiles the request's grammar (off the event loop) and admits it
   (`decode_worker.live_requests.LiveRequests.admit`: its checks, a `Stream` per choice with its
   sampler state, the matcher rebuilt from token 0, and the sequence in **waiting**). It then relays
   the stream's events to the caller until the final one.
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
states of a step's rows, which only that step's model-thread call reads and records into
(`decode_worker.step_forward`), so nothing on the event loop waits on the device; the streams' ends
are `LiveRequests`' (one final event each); the load report is `decode_worker.load`'s.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence

from decode_worker.choices import ChoiceGroup
from decode_worker.config import DecodeWorkerConfig
from decode_worker.importer import KVImporter
from decode_worker.live_requests import LiveRequests
from decode_worker.load import load_report
from decode_worker.local_prefill import LocalPrefill
from decode_worker.scheduler import DecodeScheduler, SchedulerConfig
from decode_worker.seq_state import SchedulerOutput
from decode_worker.step_budget import StepBudget
from decode_worker.step_forward import decode_seq, forward_and_sample, split_firsts
from decode_worker.stream import Stream
from decode_worker.swap_space import HostSwapSpace
from decode_worker.types import KV_LOST, DecodeRequest, TokenEvent
from engine.block_pool import BlockPool
from engine.engine import Engine
from engine.load_report import LoadReport
from engine.runner import DecodeSeq, PrefillChunk
from engine.sampling.grammar import load_grammar
from engine.sampling.prompt_logprobs import PromptLogprobs, ScoreAsk, chunk_ask
from engine.sampling.sampler import Sampled, SamplerState, TopLogprobs
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
        self.prefilling = LocalPrefill(config.prefill_chunk_size)  # admitted, KV still computed here
        # the step-time fit of this replica's measured steps and, disaggregated, each step's LOCAL budget
        self.budget = StepBudget(config.prefill_chunk_size, config.tpot_safety)
        # swapped-out KV waits in host memory allocated here, once (pinned on CUDA): `HostSwapSpace`
        self.swap_space = HostSwapSpace(engine.cache, config.max_swap_blocks)
        log.info("swap space: %d blocks, %.1f GiB of %s host memory", config.max_swap_blocks,
                 self.swap_space.nbytes / 2**30, "pinned" if self.swap_space.buffer.is_pinned() else "plain")
        self.requests = LiveRequests(engine, self.scheduler, self.prefilling, self.swap_space, importer,
                                     self.eos_ids, config.max_queue)
        self._loop = StepLoop(f"{replica_id}-step-loop", self._step, self._fail_streams)
        self.num_steps = 0
        self.step_seconds = 0.0  # inside the model thread's forwards, summed over steps
        self.step_sequences = 0
        self.step_cpu_seconds = 0.0  # CPU time of the model thread in those steps (forwards and sampling)
        self.num_swapped_out = 0

    @property
    def streams(self) -> dict[str, Stream]:  # by sequence id
        return self.requests.streams

    @property
    def groups(self) -> dict[str, ChoiceGroup]:  # by request id, while any of its streams is live
        return self.requests.groups

    @property
    def num_finished(self) -> int:
        return self.requests.num_finished

    @property
    def pool(self) -> BlockPool:
        return self.engine.pool

    # -- public API ---------------------------------------------------------------------------

    async def start(self) -> None:
        await self._loop.start()

    async def stop(self) -> None:
        await self._loop.stop()
        self.requests.end_all("error", "decode worker stopped")

    async def generate(self, req: DecodeRequest) -> AsyncIterator[TokenEvent]:
        """Every choice's events, tagged with its index: each choice's first at once, then
        ``stream_interval`` tokens per event (fewer when the consumer catches up with the end); a
        token-less end follows the tokens before it (`decode_worker.choices.Relay`)."""
        vocab = await load_grammar(req.sampling.grammar, self.engine.model_dir, self.eos_ids)
        group = self.requests.admit(req, vocab, self.colocated, self.local_prefill)
        self._loop.wake()
        wait = self.config.token_timeout_s
        try:
            async for ev in group.relay(self.config.stream_interval, wait,
                                        lambda st: self.requests.end(st, "error", f"no token within {wait:.0f} s")):
                yield ev
        finally:
            for st in group.streams:
                if not st.closed or st.seq_id in self.streams:
                    self.requests.abort(st)

    def load_report(self) -> LoadReport:
        return load_report(self)

    def is_idle(self) -> bool:
        return not self.streams and not self.scheduler.has_work()

    # -- step loop ------------------------------------------------------------------------------

    def _fail_streams(self, e: Exception) -> None:
        self.requests.end_all("error", f"decode worker error: {e}")

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
                self.requests.end(st, "error", f"model step failed: {e}")
            return
        self.num_steps += 1
        self.step_seconds += dt
        self.step_sequences += len(seqs)
        self.budget.record(len(seqs), sum(q.position for q in seqs), sum(len(c.token_ids) for c in chunks), dt)
        if decode:
            self._after_decode(decode, sampled.rows(0, len(decode)))
        if chunks:
            self._after_prefill(prefill_groups, chunks, split_firsts(sampled, len(decode), ending), scored, dt)

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
        """On the model thread: `forward_and_sample`, its CPU time counted."""
        cpu0 = time.thread_time()
        out = forward_and_sample(self.engine.runner, seqs, chunks, asks, decode, ending)
        self.step_cpu_seconds += time.thread_time() - cpu0  # < the step's wall time by its waits (GIL, cores)
        return out

    def _decode_seq(self, st: Stream) -> DecodeSeq:
        seq = self.scheduler.get(st.seq_id)
        assert seq is not None
        return decode_seq(st, seq, self.engine.model_config.rope_recompute_position)

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
                self.requests.end(st, "error", "sequence outgrew the decode pool's KV blocks")
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
                self.requests.end(st, "error", f"KV transfer failed: {e}", KV_LOST)
            return
        finally:
            group.pull_task = None
            self._loop.wake()
        for st in group.streams:
            st.transfer_s, st.transfer_bytes = stats.seconds, stats.bytes
        group.kv_in(self.scheduler, self.engine.cache)
        for st in group.streams:
            if st.aborted and not st.closed:
                self.requests.end(st, "abort")

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
            self.requests.end(st, "error", grammar.error)
        elif st.accept(tok, lp, top, prompt_logprobs, self.eos_ids) is not None:
            self.requests.forget(st)
