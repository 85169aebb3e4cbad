"""Which prompts a prefill step runs, and how many of each one's tokens: admission and the budget split.

Owns: `PrefillJob` (one request's progress through the prefill worker: its blocks, the prompt tokens
whose KV is written, its chunks) and `plan_step`, which picks a step's chunks from the waiting jobs.

Order: FIFO, or, when any job carries a TTFT deadline (``PrefillRequest.ttft_deadline``), earliest
deadline first (`engine.prefill_planner.grant_order`; a job without one counts as due after every job
that has one). Jobs are admitted in that order while the admitted ones cannot fill the step's budget
(`engine.prefill_planner.wants_more`). On admission a job matches its prompt against the prefix cache
(salted by the prompt's RoPE table: `Engine.prefix_salt`; not a job that asks for prompt log-probs,
which needs every position's logits) and reserves blocks for the rest of its prompt. The budget is then
split among the admitted jobs by `engine.prefill_planner.grant_tokens`.

Invariants: the first job in the order that finds no blocks waits, and no later job is newly admitted
past it, so a long prompt is never overtaken forever; jobs admitted before, which already hold their
blocks, still advance (and free theirs), so the wait always ends. A job's blocks cover its whole
prompt from admission on; ``computed`` only grows, by exactly the tokens granted to it.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.engine import Engine
from engine.prefill_planner import grant_order, grant_tokens, wants_more
from engine.runner import PrefillChunk
from engine.sampling.grammar import GrammarVocab
from engine.sampling.prompt_logprobs import PromptLogprobs
from engine.sampling.sampler import SamplerState
from prefill_worker.types import PrefillRequest, PrefillResult


@dataclass
class PrefillJob:
    """One request in the prefill worker, from ``prefill(req)`` until its result or failure."""

    req: PrefillRequest
    future: asyncio.Future[PrefillResult]
    enqueued: float
    sampler: SamplerState  # choice 0's (the others' are built for token 0 from the same vocabulary)
    vocab: GrammarVocab | None = None  # the grammar's, when the request has one
    blocks: list[int] = field(default_factory=list)
    num_cached: int = 0
    computed: int = 0  # prompt tokens whose KV is written (cached prefix included)
    started: float | None = None
    num_chunks: int = 0
    scores: PromptLogprobs | None = None  # the prompt's log-probs so far, when the request asks

    @property
    def prompt(self) -> tuple[int, ...]:
        return self.req.prompt_token_ids

    @property
    def remaining(self) -> int:
        return len(self.prompt) - self.computed


def plan_step(waiting: Sequence[PrefillJob], engine: Engine, max_batch_tokens: int,
              max_chunk_tokens: int | None) -> tuple[list[PrefillChunk], list[PrefillJob]]:
    """This step's chunks, one per job granted tokens (in the same order as the jobs returned);
    admits (allocates blocks for) jobs as the module docstring says."""
    budget = max_batch_tokens
    cap = min(max_chunk_tokens or budget, budget)
    pool = engine.pool
    order = list(waiting)
    deadlines = deadlines_of(order)
    if deadlines is not None:  # earliest deadline first; FIFO otherwise
        order = [order[i] for i in grant_order([j.remaining for j in order], deadlines)]
    admitted: list[PrefillJob] = []
    blocked = False  # a job found no blocks: nobody after it is newly admitted (it is never overtaken)
    for job in order:
        if not wants_more([j.remaining for j in admitted], budget, cap):
            break
        if not job.blocks:
            if blocked:
                continue
            reuse = engine.config.enable_prefix_cache and job.req.prompt_logprobs is None
            hit = pool.match_prefix(job.prompt[:-1], engine.prefix_salt(len(job.prompt))) if reuse else []
            need = engine.blocks_for(len(job.prompt)) - len(hit)
            if not pool.can_allocate(need):
                pool.free(hit)
                blocked = True  # jobs holding blocks still advance (and free theirs)
                continue
            job.blocks = hit + pool.allocate(need)
            job.num_cached = job.computed = len(hit) * engine.block_size
            job.started = time.monotonic()
        admitted.append(job)
    chunks: list[PrefillChunk] = []
    jobs: list[PrefillJob] = []
    grants = grant_tokens([j.remaining for j in admitted], budget, cap, deadlines_of(admitted))
    for job, n in zip(admitted, grants, strict=True):
        if n == 0:
            continue
        chunks.append(PrefillChunk(job.prompt[job.computed : job.computed + n], job.computed, job.blocks,
                                   prompt_len=len(job.prompt)))
        jobs.append(job)
        job.num_chunks += 1
    return chunks, jobs


def deadlines_of(jobs: Sequence[PrefillJob]) -> list[float] | None:
    """Each job's TTFT deadline, or None when no job has one (then the order is FIFO); a job without
    one (a router without objectives) counts as due after every job that has one."""
    if all(j.req.ttft_deadline is None for j in jobs):
        return None
    return [math.inf if j.req.ttft_deadline is None else j.req.ttft_deadline for j in jobs]
