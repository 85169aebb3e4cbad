"""The decode worker samples on the model thread, with the step's forwards: while the sampler is
held (on a GPU it would be waiting for the device) the event loop still serves other coroutines
(`tests.support.gate`), for token 0 of a colocated prefill and for a decode step alike, and the
tokens are still the reference's."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

import decode_worker.step_forward as decode_module
from decode_worker.types import DecodeRequest
from engine.engine import Engine
from engine.sampling.sampler import SamplingParams
from tests.support.gate import Gate
from tests.support.inprocess_pd import collect, make_colocated, random_prompt, reference

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("held", [0, 2])  # call 0 samples token 0 (colocated prefill), call 2 a decode step
async def test_sampling_is_off_the_event_loop(tiny_path: Path, ref_engine: Engine, held: int,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    worker = make_colocated(tiny_path, 0)
    gate = Gate(decode_module.sample, hold_call=held)
    monkeypatch.setattr(decode_module, "sample", gate)
    prompt = random_prompt(random.Random(2), 30)
    params = SamplingParams(max_tokens=6, temperature=0.9, seed=3, ignore_eos=True)
    await worker.start()
    try:
        task = asyncio.ensure_future(collect(worker, DecodeRequest("r", prompt, params)))
        await gate.answer()
        assert worker.load_report().num_running + worker.load_report().num_waiting == 1  # the loop serves
        tokens, reason, _ = await asyncio.wait_for(task, 60)
    finally:
        await worker.stop()
    assert gate.order == ["held", "answered", "released"] and gate.off_loop
    assert reason == "length" and tokens == reference(ref_engine, prompt, params)
