"""The LOCAL prefill budget of a decode replica: `StepBudget` (pure: `step_token_budget` of its fit,
else the prior, never 0 while a prompt waits), and a worker over a tiny model that uses it
(disaggregated: a stream with a tight TPOT objective holds a LOCAL prompt to one token a step, and the
output still equals the reference), orders its local prompts by TTFT deadline (colocated too), and
reports what the router's path decision reads."""

from __future__ import annotations

import asyncio
import random

import pytest

from decode_worker.step_budget import StepBudget
from decode_worker.types import DecodeRequest, TokenEvent
from decode_worker.worker import DecodeWorker
from engine.sampling.sampler import SamplingParams
from engine.step_model import PRIOR, StepTimeModel, step_token_budget
from tests.support.inprocess_pd import collect, make_colocated, make_pd, random_prompt, reference, wait_until

pytestmark = pytest.mark.timeout(120)

FIT = StepTimeModel(base_s=0.01, per_seq_s=0.001, per_context_token_s=1e-6, per_prefill_token_s=1e-4)


def test_the_budget_is_step_token_budget_of_the_fit_else_the_prior() -> None:
    b = StepBudget(cap=256, safety=0.8)
    assert b.model is PRIOR
    assert b.tokens(4, 400, 0.2, 1000) == step_token_budget(PRIOR, 4, 400, 0.2, 256, 0.8)
    for i in range(40):
        batch, ctx, p = 1 + i % 7, 100 * (1 + i % 5), 16 * (i % 3)
        b.record(batch, ctx, p, FIT.step_s(batch, ctx, p))
    assert b.model.per_prefill_token_s == pytest.approx(FIT.per_prefill_token_s, rel=1e-6)
    assert b.tokens(4, 400, 0.05, 1000) == step_token_budget(b.model, 4, 400, 0.05, 256, 0.8)


def test_the_budget_is_capped_and_never_stalls_a_waiting_prompt() -> None:
    b = StepBudget(cap=64)
    assert b.tokens(3, 300, None, 1000) == 64  # no objective among the streams: the cap
    assert b.tokens(3, 300, None, 20) == 20  # no more than waits
    assert b.tokens(0, 0, None, 0) == 0  # nothing waits
    assert b.tokens(30, 30_000, 0.001, 500) == 1  # no headroom: still one token a step
    assert StepBudget(cap=0).tokens(2, 10, None, 700) == 700  # no cap: every waiting token


async def first_events_order(worker: DecodeWorker, reqs: list[DecodeRequest]) -> tuple[list[str], list[list[int]]]:
    order: list[str] = []

    async def one(req: DecodeRequest) -> list[int]:
        tokens = []
        async for ev in worker.generate(req):
            if not tokens:
                order.append(req.request_id)
            tokens += ev.token_ids
        return tokens

    tasks = [asyncio.ensure_future(one(r)) for r in reqs]
    await wait_until(lambda: worker.scheduler.num_waiting == len(reqs))  # every one in before a step runs
    await worker.start()
    return order, list(await asyncio.gather(*tasks))


@pytest.mark.parametrize("deadlines", [False, True])
async def test_local_prompts_are_prefilled_earliest_deadline_first(tiny_path, ref_engine, deadlines: bool) -> None:
    rng = random.Random(11)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    long, short = random_prompt(rng, 96), random_prompt(rng, 10)
    reqs = [DecodeRequest("long", long, params, ttft_deadline=200.0 if deadlines else None),
            DecodeRequest("short", short, params, ttft_deadline=100.0 if deadlines else None)]
    worker = make_colocated(tiny_path, chunk=16)
    try:
        order, outs = await first_events_order(worker, reqs)
    finally:
        await worker.stop()
    # oldest first, the long prompt takes every step's 16 tokens until done; by deadline the short one
    # goes first and is done in the first step
    assert order == (["short", "long"] if deadlines else ["long", "short"])
    assert outs == [reference(ref_engine, long, params), reference(ref_engine, short, params)]


async def test_a_tight_objective_holds_a_local_prompt_to_a_token_a_step(tiny_path, ref_engine) -> None:
    rng = random.Random(12)
    running = DecodeRequest("running", random_prompt(rng, 20), SamplingParams(max_tokens=120, ignore_eos=True),
                            tpot_s=1e-6)
    prompt, params = random_prompt(rng, 12), SamplingParams(max_tokens=5, ignore_eos=True)
    pd = make_pd(tiny_path, local_prefill=True, local_chunk=64)
    async with pd.running():
        stream = asyncio.ensure_future(collect(pd.decode, running))
        await wait_until(lambda: pd.decode.load_report().running_tpot_s == 1e-6)
        steps0 = pd.decode.num_steps
        events: list[TokenEvent] = []
        async for ev in pd.decode.generate(DecodeRequest("local", prompt, params)):
            if not events:
                steps_to_first = pd.decode.num_steps - steps0
            events.append(ev)
        rep = pd.decode.load_report()
        await stream
    assert [t for ev in events for t in ev.token_ids] == reference(ref_engine, prompt, params)
    assert steps_to_first >= len(prompt)  # one prompt token a step beside the protected stream
    assert rep.running_context_tokens > 20 and rep.local_queue_tokens == 0


async def test_the_load_report_carries_what_the_path_decision_reads(tiny_path) -> None:
    rng = random.Random(13)
    pd = make_pd(tiny_path, local_prefill=True, local_chunk=8)
    async with pd.running():
        assert pd.decode.load_report().step_fit is None  # no steps measured yet
        a = asyncio.ensure_future(collect(pd.decode, DecodeRequest(
            "a", random_prompt(rng, 30), SamplingParams(max_tokens=60, ignore_eos=True), tpot_s=0.5)))
        b = asyncio.ensure_future(collect(pd.decode, DecodeRequest(
            "b", random_prompt(rng, 14), SamplingParams(max_tokens=60, ignore_eos=True), tpot_s=0.25)))
        await wait_until(lambda: pd.decode.load_report().running_tpot_s == 0.25)
        rep = pd.decode.load_report()
        seqs = [pd.decode.scheduler.get(f"{r}#0") for r in ("a", "b")]
        assert rep.running_context_tokens == sum(s.num_tokens for s in seqs if s is not None)
        await asyncio.gather(a, b)
        rep = pd.decode.load_report()
    assert rep.running_tpot_s is None and rep.running_context_tokens == 0
    assert pd.decode.num_steps >= 32 and rep.step_fit is not None and len(rep.step_fit) == 4
    assert rep.step_fit == (lambda m: (m.base_s, m.per_seq_s, m.per_context_token_s, m.per_prefill_token_s))(
        pd.decode.budget.model)
