"""The prefill worker's deadline order (``PrefillRequest.ttft_deadline``), over a tiny model, stepped by
hand so that time is counted in steps (a fake clock: step ``s`` runs from time ``s`` to ``s + 1``):
a short prompt due earlier gets token 0 before a long one queued first, a long prompt still meets
its own deadline under a stream of short ones, a prompt due first that finds no KV blocks waits
while the job holding them advances, and without deadlines the order is FIFO as before.
Token 0 is the reference's either way."""

from __future__ import annotations

import asyncio
import math
import random
from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.engine import Engine
from engine.sampling.sampler import SamplingParams
from kv_transfer.config import KVTransferConfig
from kv_transfer.outbox import Outbox
from prefill_worker.config import PrefillWorkerConfig
from prefill_worker.types import PrefillRequest, PrefillResult
from prefill_worker.worker import PrefillWorker
from tests.support.inprocess_pd import EOS, random_prompt, reference

pytestmark = pytest.mark.timeout(240)

PARAMS = SamplingParams(max_tokens=1, ignore_eos=True)  # token 0 only: the blocks are freed at once


class Stepped:
    """A prefill worker whose step loop is not started: the test queues requests and runs each step."""

    def __init__(self, path: Path, budget: int, cap: int | None, num_blocks: int = 128) -> None:
        engine = Engine.from_dir(path, EngineConfig(num_blocks=num_blocks, block_size=16))
        outbox = Outbox(engine.pool.free, default_lease_s=30.0)
        self.worker = PrefillWorker(engine, PrefillWorkerConfig(max_batch_tokens=budget, max_chunk_tokens=cap,
                                                                kv=KVTransferConfig(lease_s=30.0)),
                                    outbox, source=("inproc", 1), eos_token_ids=(EOS,))
        self.now = 0  # steps run so far: the fake clock
        self.tasks: dict[str, asyncio.Future[PrefillResult]] = {}
        self.done_at: dict[str, int] = {}  # request → the time its token 0 was out

    async def queue(self, rid: str, prompt: tuple[int, ...], deadline: float | None) -> None:
        self.tasks[rid] = asyncio.ensure_future(
            self.worker.prefill(PrefillRequest(rid, prompt, PARAMS, ttft_deadline=deadline)))
        while not any(j.req.request_id == rid for j in self.worker.waiting):
            await asyncio.sleep(0)

    async def step(self) -> None:
        jobs = list(self.worker.waiting)
        assert jobs, "a step with nothing queued would idle on the wall clock"
        await self.worker._step()
        self.now += 1
        for job in jobs:
            if job.future.done() and job.req.request_id not in self.done_at:
                self.done_at[job.req.request_id] = self.now

    async def results(self) -> dict[str, PrefillResult]:
        return dict(zip(self.tasks, await asyncio.gather(*self.tasks.values()), strict=True))


@pytest.mark.parametrize("deadlines", [True, False])
async def test_a_short_prompt_due_first_passes_a_long_one_queued_before_it(
        tiny_path: Path, ref_engine: Engine, deadlines: bool) -> None:
    """No chunk cap, so FIFO gives the long prompt every step until its last; due first, the short
    one is admitted ahead of it and gets token 0 in the first step."""
    pd = Stepped(tiny_path, budget=256, cap=None)
    rng = random.Random(11)
    long, short = random_prompt(rng, 600), random_prompt(rng, 20)
    await pd.queue("long", long, 10.0 if deadlines else None)
    await pd.queue("short", short, 1.0 if deadlines else None)
    while len(pd.done_at) < 2:
        await pd.step()
    out = await pd.results()
    if deadlines:
        assert pd.done_at == {"short": 1, "long": 3}  # 20 + 236, then 256, then 108
    else:
        assert pd.done_at == {"long": 3, "short": 3}  # 256, 256, then 88 with the short one beside it
    assert out["long"].timings.num_chunks == 3 and out["short"].timings.num_chunks == 1
    for rid, prompt in (("long", long), ("short", short)):
        assert out[rid].choices[0].token_id == reference(ref_engine, prompt, PARAMS)[0]
    assert pd.worker.engine.pool.num_used_blocks == 0


@pytest.mark.parametrize("deadlines", [True, False])
async def test_a_long_prompt_meets_its_deadline_under_a_stream_of_short_ones(
        tiny_path: Path, ref_engine: Engine, deadlines: bool) -> None:
    """A 300-token prompt due at 24, then a 48-token prompt every step, each due 3 steps after it
    arrives; 64 tokens a step. By deadlines every short prompt is served in the step after it arrives
    and the long one advances on what they leave (16 a step), done by 19: every deadline is met,
    though the stream never stops. FIFO (no deadlines) runs the long prompt first and the short
    prompts queued behind it miss theirs."""
    t_short, t_long, steps = 3, 24, 30
    pd = Stepped(tiny_path, budget=64, cap=None)
    rng = random.Random(12)
    long = random_prompt(rng, 300)
    shorts = {f"s{t}": random_prompt(rng, 48) for t in range(steps)}
    due = {"long": t_long} | {f"s{t}": t + t_short for t in range(steps)}
    await pd.queue("long", long, t_long if deadlines else None)
    for t in range(steps):
        await pd.queue(f"s{t}", shorts[f"s{t}"], t + t_short if deadlines else None)
        await pd.step()
    while len(pd.done_at) < len(due):  # the stream has stopped: drain what is left
        await pd.step()
    out = await pd.results()
    missed = sorted(rid for rid, t in pd.done_at.items() if t > due[rid])
    if deadlines:
        assert missed == [] and pd.done_at["long"] == 19
        assert all(pd.done_at[f"s{t}"] == t + 1 for t in range(steps))
    else:
        assert pd.done_at["long"] == 5 and "s0" in missed  # 64 a step for the long one, the rest wait
    for rid, prompt in [("long", long), *list(shorts.items())[:3]]:
        assert out[rid].choices[0].token_id == reference(ref_engine, prompt, PARAMS)[0]
    assert pd.worker.engine.pool.num_used_blocks == 0


async def test_a_job_due_first_without_blocks_waits_while_the_one_holding_them_advances(
        tiny_path: Path, ref_engine: Engine) -> None:
    """The long prompt holds all but two blocks after its first chunk; the short one, due first,
    cannot have its three: it waits, and the long one (admitted, its blocks reserved) keeps
    advancing, so the blocks come back and nothing stalls."""
    rng = random.Random(13)
    long, short = random_prompt(rng, 300), random_prompt(rng, 48)
    pd = Stepped(tiny_path, budget=64, cap=None, num_blocks=19 + 2)  # 300 tokens: 19 blocks of 16
    await pd.queue("long", long, 10.0)
    await pd.step()
    await pd.queue("short", short, 2.0)
    for _ in range(8):
        if len(pd.done_at) == 2:
            break
        await pd.step()
    assert pd.done_at == {"long": 5, "short": 6}  # 64 a step for 300 tokens, then the short one
    out = await pd.results()
    for rid, prompt in (("long", long), ("short", short)):
        assert out[rid].choices[0].token_id == reference(ref_engine, prompt, PARAMS)[0]


@pytest.mark.parametrize("deadline", [math.inf, math.nan])
def test_a_deadline_is_a_finite_time(deadline: float) -> None:
    with pytest.raises(ValueError, match="ttft_deadline must be a finite time"):
        PrefillRequest("r", (5, 6), PARAMS, ttft_deadline=deadline)
