"""The prefill worker samples token 0 on the model thread, with its forward: while the sampler is
held (on a GPU it would be waiting for the device) the event loop still serves other coroutines
(`tests.support.gate`), and token 0 is still the reference's; a step that completes several prompts
samples all their choices in one call."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
import torch

import prefill_worker.worker as prefill_module
from engine.engine import Engine
from engine.sampling.choices import choice_params
from engine.sampling.sampler import Sampled, SamplerState, SamplingParams
from prefill_worker.types import PrefillRequest
from tests.support.gate import Gate
from tests.support.inprocess_pd import make_pd, random_prompt, reference

pytestmark = pytest.mark.timeout(120)


async def test_token_0_is_sampled_off_the_event_loop(tiny_path: Path, ref_engine: Engine,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    pd = make_pd(tiny_path)
    gate = Gate(prefill_module.sample)
    monkeypatch.setattr(prefill_module, "sample", gate)
    prompt = random_prompt(random.Random(1), 40)
    params = SamplingParams(max_tokens=4, temperature=0.8, seed=7)
    await pd.prefill.start()
    try:
        task = asyncio.ensure_future(pd.prefill.prefill(PrefillRequest("r", prompt, params)))
        await gate.answer()
        assert pd.prefill.load_report().num_running == 1  # the loop serves while token 0 is sampled
        res = await asyncio.wait_for(task, 60)
    finally:
        await pd.prefill.stop()
    assert gate.order == ["held", "answered", "released"] and gate.off_loop
    assert res.choices[0].token_id == reference(ref_engine, prompt, params)[0]
    if res.handle is not None:
        pd.outbox.release(res.handle.transfer_id)


async def test_one_sample_call_per_step_for_every_job_it_completes(tiny_path: Path, ref_engine: Engine,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Three prompts in one step, one with three choices: one `sample` call (one wait on the device)
    samples all five tokens 0, each the reference's for its choice's seed."""
    pd = make_pd(tiny_path, max_batch_tokens=256)
    calls: list[int] = []
    real = prefill_module.sample

    def counted(logits: torch.Tensor, states: list[SamplerState]) -> Sampled:
        calls.append(len(states))
        return real(logits, states)

    monkeypatch.setattr(prefill_module, "sample", counted)
    rng = random.Random(3)
    reqs = [PrefillRequest("a", random_prompt(rng, 30), SamplingParams(max_tokens=1)),
            PrefillRequest("b", random_prompt(rng, 50), SamplingParams(max_tokens=1, temperature=1.0, seed=9), n=3),
            PrefillRequest("c", random_prompt(rng, 20), SamplingParams(max_tokens=1, temperature=0.7, seed=4))]
    tasks = [asyncio.ensure_future(pd.prefill.prefill(r)) for r in reqs]
    await asyncio.sleep(0)  # all three queued before the step loop runs
    await pd.prefill.start()
    try:
        results = await asyncio.wait_for(asyncio.gather(*tasks), 60)
    finally:
        await pd.prefill.stop()
    assert calls == [5]
    for req, res in zip(reqs, results, strict=True):
        want = [reference(ref_engine, req.prompt_token_ids, choice_params(req.sampling, i))[0] for i in range(req.n)]
        assert [f.token_id for f in res.choices] == want
