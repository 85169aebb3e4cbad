"""`PrefillWorker`: prompts in, token 0 and a KV handle out.

Life cycle of a request (each name is a queue or a state in this file):

1. ``prefill(req)`` checks the length and the queue bound, then appends a `PrefillJob` to ``waiting``.
2. The step loop admits jobs from ``waiting`` (FIFO, or earliest TTFT deadline first when any job
   carries one), each reserving blocks for its prompt less a prefix-cache hit, and splits the step's
   token budget among them (`prefill_worker.step_plan`, which states the rules and invariants).
3. Each step packs chunks of the admitted jobs into one forward under ``max_batch_tokens``
   (`engine.prefill_planner`): a long prompt is prefilled over several steps (chunked prefill) and
   short prompts pass it between its chunks; several short prompts share one forward. A job that asks
   for prompt log-probs has each chunk's scored in the same forward (`engine.sampling.prompt_logprobs`).
4. After its last chunk a job samples token 0 (``n`` choices: one token 0 per choice, each from
   the same logits with its choice's seed, `engine.sampling.choices`), registers its full blocks in the
   prefix cache, and its blocks move to the **outbox** under a lease; the caller gets a
   `PrefillResult` with a `KVHandle`. If token 0 already ends the request (EOS, a stop id,
   ``max_tokens == 1``, a complete grammar; for every choice) the blocks are freed at once and the
   result has no handle. Token 0 is sampled under the request's grammar (compiled, off the event
   loop, before the job is queued); a token the grammar rejects fails the request rather than leave
   this worker.
5. The decode side pulls the blocks and sends DONE (or RELEASE); the outbox frees them then, or
   when the lease expires.

Invariants: the model runs only in the step loop (one forward at a time, on the engine's
`ModelThread`, so the event loop keeps serving); token 0 is sampled there too, right after the
forward and in one `sample` call for the step, so nothing on the event loop waits on the device;
jobs are touched only on the event loop, except the sampler states of the jobs a step completes,
which only that step's model-thread call reads and records into; every block a job holds is freed
exactly once — by the outbox, or here on failure or cancellation.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import deque
from collections.abc import Sequence

import torch

from engine.engine import Engine
from engine.errors import QueueFullError
from engine.load_report import LoadReport
from engine.runner import PrefillChunk
from engine.sampling.choices import choice_params
from engine.sampling.grammar import GrammarError, load_grammar
from engine.sampling.prompt_logprobs import PromptLogprobs, ScoreAsk, check_prompt_logprobs, chunk_ask
from engine.sampling.sampler import Sampled, SamplerState, sample
from engine.step_loop import StepLoop
from kv_transfer.handle import KVHandle
from kv_transfer.layout import KVLayout
from kv_transfer.outbox import Outbox
from prefill_worker.config import PrefillWorkerConfig
from prefill_worker.step_plan import PrefillJob, plan_step
from prefill_worker.types import FirstToken, PrefillRequest, PrefillResult, PrefillTimings

log = logging.getLogger(__name__)


class PrefillWorker:
    """Token-budget batching + chunked prefill + prefix reuse, over one `Engine`."""

    def __init__(
        self,
        engine: Engine,
        config: PrefillWorkerConfig,
        outbox: Outbox,
        source: tuple[str, int],
        eos_token_ids: Sequence[int] = (),
        replica_id: str = "prefill",
    ) -> None:
        self.engine = engine
        self.config = config
        self.outbox = outbox
        self.source = source
        self.eos_ids = tuple(eos_token_ids)
        self.replica_id = replica_id
        self.layout = KVLayout.from_model(engine.model_config, engine.config.dtype, engine.block_size)
        self.prefill_tokens = 0  # cumulative, for the load report's measured rate (written on the model thread)
        self.prefill_seconds = 0.0
        self.waiting: deque[PrefillJob] = deque()
        self._loop = StepLoop(f"{replica_id}-step-loop", self._step, self._fail_waiting)
        self.num_prefilled = 0

    # -- public API ---------------------------------------------------------------------------

    async def start(self) -> None:
        await self._loop.start()

    async def stop(self) -> None:
        await self._loop.stop()
        self._fail_waiting(RuntimeError("prefill worker stopped"))

    async def prefill(self, req: PrefillRequest) -> PrefillResult:
        self.engine.check_length(len(req.prompt_token_ids), req.sampling.max_tokens)
        check_prompt_logprobs(req.prompt_logprobs)
        needed = self.engine.blocks_for(len(req.prompt_token_ids))
        if needed > self.engine.pool.num_blocks:
            raise ValueError(
                f"prompt of {len(req.prompt_token_ids)} tokens needs {needed} KV blocks; this prefill "
                f"replica has {self.engine.pool.num_blocks}"
            )
        if len(self.waiting) >= self.config.max_queue:
            raise QueueFullError(f"prefill queue is full ({self.config.max_queue} waiting)", 1.0)
        vocab = await load_grammar(req.sampling.grammar, self.engine.model_dir, self.eos_ids)
        sampler = SamplerState.new(req.sampling, req.prompt_token_ids, eos_ids=self.eos_ids, vocab=vocab)
        job = PrefillJob(req=req, future=asyncio.get_running_loop().create_future(), enqueued=time.monotonic(),
                   sampler=sampler, vocab=vocab)
        self.waiting.append(job)
        self._loop.wake()
        try:
            return await asyncio.shield(job.future)
        except asyncio.CancelledError:
            job.future.cancel()  # the step loop frees the job's blocks when it sees this
            if job.future.done() and not job.future.cancelled() and job.future.exception() is None:
                handle = job.future.result().handle  # finished just before the caller gave up:
                if handle is not None:  # nobody will ever see this handle, so nobody will pull it
                    self.outbox.release(handle.transfer_id)
            raise

    def load_report(self) -> LoadReport:
        pool = self.engine.pool
        return LoadReport(
            replica_id=self.replica_id,
            role="prefill",
            num_waiting=sum(1 for j in self.waiting if j.started is None),
            num_running=sum(1 for j in self.waiting if j.started is not None),
            outstanding_tokens=sum(j.remaining for j in self.waiting),
            kv_blocks_free=pool.num_free_blocks,
            kv_blocks_total=pool.num_blocks,
            prefill_tokens=self.prefill_tokens,
            prefill_seconds=self.prefill_seconds,
        )

    # -- step loop ------------------------------------------------------------------------------

    async def _step(self) -> None:
        self.outbox.expire()
        self._drop_cancelled()
        chunks, jobs = self._plan()
        if not chunks:  # wake on a new request, or poll: blocks come back as the outbox drains
            await self._loop.idle(0.05 if self.waiting else 1.0)
            return
        asks = [chunk_ask(j.prompt, c.start_pos, len(c.token_ids), j.req.prompt_logprobs)
                for j, c in zip(jobs, chunks, strict=True)]
        ending = [(row, j) for row, (j, c) in enumerate(zip(jobs, chunks, strict=True))
                  if len(c.token_ids) == j.remaining]  # jobs whose last chunk this step runs
        try:  # the forward and token 0's sampling, off the event loop: the loop never waits on the device
            scored, firsts = await self.engine.model_thread.run(self._forward, chunks, asks, ending)
        except Exception as e:  # a failed forward fails its jobs, never the worker
            log.exception("prefill forward failed")
            for job in jobs:
                self._remove(job)
                self._fail(job, e)
            return
        ends = iter(firsts)
        for row, (job, chunk) in enumerate(zip(jobs, chunks, strict=True)):
            job.computed += len(chunk.token_ids)
            if (part := scored[row]) is not None:
                job.scores = part if job.scores is None else job.scores + part
            if job.remaining == 0:
                self._remove(job)
                self._finish(job, next(ends))

    def _forward(self, chunks: list[PrefillChunk], asks: list[ScoreAsk | None], ending: list[tuple[int, PrefillJob]],
                 ) -> tuple[list[PromptLogprobs | None], list[list[FirstToken] | GrammarError]]:
        """On the model thread: the step's forward, then token 0 of every choice of the jobs whose
        last chunk it ran (``ending``: (row, job), in row order) in one `sample` call, the step's one
        wait on the device; per job its first tokens, or the `GrammarError` of a rejected token."""
        start = time.perf_counter()
        logits, scored = self.engine.runner.prefill_scored(chunks, asks)  # [len(chunks), V]
        firsts: list[list[FirstToken] | GrammarError] = []
        sampled: list[tuple[int, PrefillJob, list[SamplerState]]] = []  # (its place in firsts, job, choices' states)
        rows: list[torch.Tensor] = []
        for row, job in ending:
            try:
                states = self._choice_states(job)
            except GrammarError as e:  # a choice's grammar does not compile: this job fails alone
                firsts.append(e)
                continue
            sampled.append((len(firsts), job, states))
            rows.append(logits[row : row + 1].expand(len(states), -1))  # [n, V]
            firsts.append([])
        if rows:
            out = sample(torch.cat(rows), [s for _, _, states in sampled for s in states])  # [sum of n, V]
            at = 0
            for i, job, states in sampled:
                firsts[i] = self._first_tokens(job, states, out.rows(at, at + len(states)))
                at += len(states)
        self.prefill_seconds += time.perf_counter() - start  # token 0's sampling in: it is the forward's
        self.prefill_tokens += sum(len(c.token_ids) for c in chunks)
        return scored, firsts

    def _plan(self) -> tuple[list[PrefillChunk], list[PrefillJob]]:
        """This step's chunks and their jobs (`prefill_worker.step_plan`)."""
        return plan_step(list(self.waiting), self.engine, self.config.max_batch_tokens, self.config.max_chunk_tokens)

    def _choice_states(self, job: PrefillJob) -> list[SamplerState]:
        """Each choice's sampler state for token 0 (its seed, its grammar matcher), choice 0's first."""
        req = job.req
        return [job.sampler, *(SamplerState.new(choice_params(req.sampling, i), req.prompt_token_ids,
                                                eos_ids=self.eos_ids, vocab=job.vocab) for i in range(1, req.n))]

    def _first_tokens(self, job: PrefillJob, states: list[SamplerState],
                      out: Sampled) -> list[FirstToken] | GrammarError:
        """Token 0 of each choice as ``out`` sampled it with the choice's state, or the error of a
        grammar that rejected one."""
        req = job.req
        firsts = []
        for st, token, logprob, top in zip(states, *out, strict=True):
            grammar = st.grammar
            if grammar is not None and grammar.error is not None:
                return GrammarError(grammar.error)
            stop = req.sampling.is_stop(token, self.eos_ids) or (grammar is not None and grammar.done)
            reason = "stop" if stop else ("length" if req.sampling.max_tokens == 1 else None)
            firsts.append(FirstToken(token, logprob, top, reason))
        return firsts

    def _finish(self, job: PrefillJob, firsts: list[FirstToken] | GrammarError) -> None:
        req = job.req
        if isinstance(firsts, GrammarError):  # never hand on a token the grammar rejected
            self._fail(job, firsts)
            return
        pool = self.engine.pool
        pool.commit_full_blocks(job.blocks, job.prompt, self.engine.prefix_salt(len(job.prompt)))
        timings = PrefillTimings(
            queue_s=(job.started or job.enqueued) - job.enqueued,
            prefill_s=time.monotonic() - (job.started or job.enqueued),
            num_chunks=job.num_chunks,
        )
        self.num_prefilled += 1
        ended = all(f.finish_reason is not None for f in firsts)
        if ended or job.future.done():  # done: the caller gave up
            pool.free(job.blocks)
            result = PrefillResult(
                request_id=req.request_id, choices=tuple(firsts), handle=None, finished=True,
                num_cached_tokens=job.num_cached, timings=timings, prompt_logprobs=job.scores,
            )
        else:
            transfer_id = f"{req.request_id}-{uuid.uuid4().hex[:12]}"
            expires_mono = self.outbox.put(transfer_id, job.blocks, len(job.prompt))
            expires_at = time.time() + (expires_mono - time.monotonic())  # handles carry wall time
            handle = KVHandle(
                transfer_id=transfer_id, source_host=self.source[0], source_port=self.source[1],
                n_tokens=len(job.prompt), layout=self.layout, expires_at=expires_at,
            )
            result = PrefillResult(
                request_id=req.request_id, choices=tuple(firsts), handle=handle,
                num_cached_tokens=job.num_cached, timings=timings, prompt_logprobs=job.scores,
            )
        if not job.future.done():
            job.future.set_result(result)

    def _drop_cancelled(self) -> None:
        for job in [j for j in self.waiting if j.future.cancelled()]:
            self._remove(job)
            if job.blocks:
                self.engine.pool.free(job.blocks)

    def _remove(self, job: PrefillJob) -> None:
        with contextlib.suppress(ValueError):
            self.waiting.remove(job)

    def _fail_waiting(self, exc: BaseException) -> None:
        while self.waiting:
            self._fail(self.waiting.popleft(), exc)

    def _fail(self, job: PrefillJob, exc: BaseException) -> None:
        if job.blocks:
            self.engine.pool.free(job.blocks)
            job.blocks = []
        if not job.future.done():
            job.future.set_exception(exc)

