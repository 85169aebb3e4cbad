"""The prefill worker samples token 0 on the model thread, with its forward: while the sampler is
held (on a GPU it would be waiting for the device) the event loop still serves other coroutines
(`tests.support.gate`), and token 0 is still the reference's."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

import prefill_worker.worker as prefill_module
from engine.engine import Engine
from engine.sampling.sampler import SamplingParams
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
    assert res.token_id == reference(ref_engine, prompt, params)[0]
    if res.handle is not None:
        pd.outbox.release(res.handle.transfer_id)
