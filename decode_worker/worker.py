"""`DecodeWorker`: continuous batching over the paged KV cache, one token per sequence per step.

Life cycle of a request (the queues are `decode_worker.scheduler.DecodeScheduler`'s):

1. ``generate(req)`` compiles the request's grammar (off the event loop), checks length and queue
   bound, creates a `Stream` (its sampler state: the matcher rebuilt from token 0) and adds the
   sequence to **waiting**. It then relays the stream's events to the caller until the final one.
2. The step loop calls ``schedule()``. An admitted sequence has blocks reserved for its prompt KV
   plus the next token and moves to **transferring**: disaggregated, a pull task imports the KV
   from the prefill replica's outbox (`KVImporter`); colocated, the worker prefills the prompt
   itself, whole or ``prefill_chunk_size`` tokens per step, between decode steps.
3. When the KV is in, the sequence is **running**: every step runs one batched decode over all
   running sequences (the first step feeds token 0), samples, and pushes each new token to its
   stream. Blocks are appended at block boundaries; when they run out the scheduler swaps the
   youngest sequence out to host memory (**swapped**) and back in later — the decode pool never
   recomputes, so it never runs a prefill in disaggregated mode.
4. A stream ends on EOS (unless ``ignore_eos``), a stop id, a complete grammar, ``max_tokens``, an
   error (a token the request's grammar rejects is one, never emitted), or abort:
   the caller closing the stream frees its blocks before the next step (a transfer in flight is
   allowed to finish first, so nothing is ever written into blocks someone else owns).

Invariants: the scheduler, pool and streams are touched only on the event loop; the model runs on the
engine's `ModelThread`, one forward at a time; each stream gets exactly one final event.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Sequence

import torch

from decode_worker.config import DecodeWorkerConfig
from decode_worker.importer import KVImporter
from decode_worker.scheduler import DecodeScheduler, SchedulerConfig, SchedulerOutput, SeqStatus
from decode_worker.stream import Stream
from decode_worker.types import KV_LOST, DecodeRequest, TokenEvent, merge_events
from engine.engine import Engine
from engine.errors import QueueFullError
from engine.grammar import GrammarVocab, load_grammar
from engine.load_report import LoadReport
from engine.prefill_planner import grant_tokens
from engine.runner import DecodeSeq, PrefillChunk
from engine.sampling import SamplerState, TopLogprobs, sample
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
            ),
            engine.pool,
        )
        self.streams: dict[str, Stream] = {}
        self.prefilling: list[Stream] = []  # colocated: admitted, prompt KV still being computed
        self.host_swap: dict[str, torch.Tensor] = {}
        self._loop = StepLoop(f"{replica_id}-step-loop", self._step, self._fail_streams)
        self._background: set[asyncio.Future[None]] = set()
        self.num_steps = 0
        self.step_seconds = 0.0  # inside the model thread's forwards, summed over steps
        self.step_sequences = 0
        self.step_cpu_seconds = 0.0  # CPU time of the model thread in those forwards
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
        """The stream's events: its first at once, then ``stream_interval`` tokens per event (fewer
        when the consumer catches up with the end); a token-less end follows the tokens before it."""
        vocab = await load_grammar(req.sampling.grammar, self.engine.model_dir, self.eos_ids)
        stream = self._admit(req, vocab)
        interval = self.config.stream_interval
        held: TokenEvent | None = None  # tokens not yet sent, fewer than the interval
        sent = False
        try:
            while True:
                try:
                    ev = await asyncio.wait_for(stream.next_event(), self.config.token_timeout_s)
                except asyncio.TimeoutError:
                    self._end(stream, "error", f"no token within {self.config.token_timeout_s:.0f} s")
                    continue  # the error event is queued now
                if held is not None:
                    if ev.token_ids:
                        ev = merge_events([held, ev])
                    else:
                        yield held
                    held = None
                if sent and ev.finish_reason is None and len(ev.token_ids) < interval:
                    held = ev
                    continue
                yield ev
                sent = True
                if ev.finish_reason is not None:
                    return
        finally:
            if not stream.closed or req.request_id in self.streams:
                self._abort(stream)

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
        )

    def is_idle(self) -> bool:
        return not self.streams and not self.scheduler.has_work()

    # -- admission and abort ------------------------------------------------------------------

    def _admit(self, req: DecodeRequest, vocab: GrammarVocab | None = None) -> Stream:
        n_prompt = len(req.prompt_token_ids)
        if self.colocated != (req.handle is None):
            raise ValueError(
                "colocated decode takes requests without a KV handle"
                if self.colocated
                else "disaggregated decode needs a KV handle (prefill first)"
            )
        self.engine.check_length(n_prompt, req.sampling.max_tokens)
        if req.request_id in self.streams:
            raise ValueError(f"request id {req.request_id!r} is already streaming")
        if self._queued_beyond_free_slots() >= self.config.max_queue:
            raise QueueFullError(f"decode queue is full ({self.config.max_queue} waiting)", 1.0)
        sampled = () if req.first_token_id is None else (req.first_token_id,)  # token 0, from the prefill
        sampler = SamplerState.new(req.sampling, req.prompt_token_ids, sampled, self.eos_ids, vocab)
        stream = Stream(req=req, sampler=sampler)
        if not self.colocated:
            assert req.first_token_id is not None
            stream.generated.append(req.first_token_id)
            stream.next_token = req.first_token_id
        self.scheduler.add(req.request_id, n_prompt, arrival=stream.enqueued)
        self.streams[req.request_id] = stream
        self._loop.wake()
        return stream

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
        seq = self.scheduler.get(stream.request_id)
        if seq is not None and seq.status is SeqStatus.TRANSFERRING and stream.pull_task is not None:
            return  # the pull task sees `aborted` and finishes the sequence
        if seq is not None and seq.status is SeqStatus.WAITING and stream.req.handle is not None:
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
        """Finish a stream without a new token; frees its blocks and forgets it."""
        stream.close(reason, error, code)
        self._forget(stream)

    def _forget(self, stream: Stream) -> None:
        self.scheduler.finish(stream.request_id)
        self.host_swap.pop(stream.request_id, None)
        with contextlib.suppress(ValueError):
            self.prefilling.remove(stream)
        if self.streams.pop(stream.request_id, None) is not None:
            self.num_finished += 1

    # -- step loop ------------------------------------------------------------------------------

    def _fail_streams(self, e: Exception) -> None:
        for st in list(self.streams.values()):
            self._end(st, "error", f"decode worker error: {e}")

    async def _step(self) -> None:
        out = self.scheduler.schedule()
        self._execute_swaps_and_admissions(out)
        decode = [self.streams[s.request_id] for s in out.decode if s.request_id in self.streams]
        chunks, prefill_streams = self._plan_prefill()
        if not decode and not chunks:
            await self._loop.idle(1.0)
            return
        seqs = [self._decode_seq(st) for st in decode]
        try:
            t0 = time.monotonic()
            dec_logits, pre_logits = await self.engine.model_thread.run(self._forward, seqs, chunks)
            dt = time.monotonic() - t0
        except Exception as e:
            log.exception("decode step failed")
            for st in decode + prefill_streams:
                self._end(st, "error", f"model step failed: {e}")
            return
        self.num_steps += 1
        self.step_seconds += dt
        self.step_sequences += len(seqs)
        if dec_logits is not None:
            self._after_decode(decode, dec_logits)
        if pre_logits is not None:
            self._after_prefill(prefill_streams, chunks, pre_logits, dt)

    def _forward(
        self, seqs: list[DecodeSeq], chunks: list[PrefillChunk]
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        cpu0 = time.thread_time()
        runner = self.engine.runner
        dec = runner.decode(seqs) if seqs else None
        pre = runner.prefill(chunks) if chunks else None
        self.step_cpu_seconds += time.thread_time() - cpu0  # < the step's wall time by its waits (GIL, cores)
        return dec, pre

    def _decode_seq(self, st: Stream) -> DecodeSeq:
        seq = self.scheduler.get(st.request_id)
        assert seq is not None and st.next_token is not None
        if st.decode_started is None:
            st.decode_started = time.monotonic()
        return DecodeSeq(st.next_token, seq.num_tokens, seq.block_ids)

    def _execute_swaps_and_admissions(self, out: SchedulerOutput) -> None:
        cache = self.engine.cache
        for seq, blocks in out.swap_out:  # first: these ids may already be reused below
            self.host_swap[seq.request_id] = cache.gather_blocks(blocks)
            self.num_swapped_out += 1
        for seq, blocks in out.swap_in:
            cache.scatter_blocks(blocks, self.host_swap.pop(seq.request_id))
        for seq in out.failed:
            st = self.streams.get(seq.request_id)
            if st is not None:
                self._end(st, "error", "sequence outgrew the decode pool's KV blocks")
        for seq in out.admitted:
            st = self.streams[seq.request_id]
            st.admitted_at = time.monotonic()
            if self.colocated:
                self.prefilling.append(st)
            else:
                st.pull_task = asyncio.create_task(self._pull(st, list(seq.block_ids)))

    async def _pull(self, st: Stream, block_ids: list[int]) -> None:
        assert self.importer is not None and st.req.handle is not None
        try:
            stats = await self.importer.pull(st.req.handle, self.engine.cache, block_ids)
        except Exception as e:
            log.warning("KV pull for %s failed: %s", st.request_id, e)
            self.scheduler.on_transfer_failed(st.request_id)
            self._end(st, "error", f"KV transfer failed: {e}", KV_LOST)
            return
        finally:
            st.pull_task = None
            self._loop.wake()
        st.transfer_s, st.transfer_bytes = stats.seconds, stats.bytes
        if st.aborted:
            self._end(st, "abort")
        else:
            self.scheduler.on_transfer_done(st.request_id)

    def _plan_prefill(self) -> tuple[list[PrefillChunk], list[Stream]]:
        """Colocated only: whole prompts at once, or ``prefill_chunk_size`` tokens this step split as
        the prefill pool splits its budget (`engine.prefill_planner`)."""
        remaining = [len(st.req.prompt_token_ids) - st.prefilled for st in self.prefilling]
        budget = self.config.prefill_chunk_size or sum(remaining)
        cap = self.config.prefill_chunk_size or max(remaining, default=1)
        chunks: list[PrefillChunk] = []
        streams: list[Stream] = []
        for st, n in zip(self.prefilling, grant_tokens(remaining, budget, cap), strict=True):
            if n == 0:
                continue
            seq = self.scheduler.get(st.request_id)
            assert seq is not None
            prompt = st.req.prompt_token_ids
            chunks.append(PrefillChunk(prompt[st.prefilled : st.prefilled + n], st.prefilled, seq.block_ids))
            streams.append(st)
        return chunks, streams

    def _after_prefill(
        self, streams: list[Stream], chunks: list[PrefillChunk], logits: torch.Tensor, dt: float
    ) -> None:
        for row, (st, chunk) in enumerate(zip(streams, chunks, strict=True)):
            if st.request_id not in self.streams:
                continue  # aborted while the step ran; its blocks are already free
            st.prefilled += len(chunk.token_ids)
            st.prefill_s += dt
            if st.prefilled < len(st.req.prompt_token_ids):
                continue
            self.prefilling.remove(st)
            self.scheduler.on_transfer_done(st.request_id)
            out = sample(logits[row : row + 1], [st.sampler])
            self._emit(st, out.token_ids[0], out.logprobs[0], out.top[0])

    def _after_decode(self, streams: list[Stream], logits: torch.Tensor) -> None:
        out = sample(logits, [st.sampler for st in streams])
        for st, tok, lp, top in zip(streams, *out, strict=True):
            if st.request_id not in self.streams:
                continue  # aborted while the step ran; its blocks are already free
            self.scheduler.on_token(st.request_id)
            self._emit(st, tok, lp, top)

    def _emit(self, st: Stream, tok: int, lp: float, top: TopLogprobs = ()) -> None:
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
        st.push(tok, lp, reason, top)
        if reason is not None:
            self._forget(st)
