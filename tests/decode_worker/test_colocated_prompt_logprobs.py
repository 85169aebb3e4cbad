"""Colocated prompt log-probs over a tiny model: token 0's event carries them, equal to transformers'
whether the prompt is prefilled whole or in chunks beside a plain request; a disaggregated decode
worker refuses the ask (the prefill pool computes them)."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from decode_worker.config import DecodeWorkerConfig
from decode_worker.importer import InProcessImporter
from decode_worker.types import DecodeChoice, DecodeRequest, TokenEvent, merge_events
from decode_worker.worker import DecodeWorker
from engine.sampling.prompt_logprobs import PromptLogprobs
from engine.sampling.sampler import SamplingParams
from tests.support.inprocess_pd import make_colocated, random_prompt, reference
from tests.support.prompt_logprobs_oracle import assert_close, hf_prompt_logprobs

pytestmark = pytest.mark.timeout(240)
PARAMS = SamplingParams(max_tokens=5, ignore_eos=True)


@pytest.fixture(scope="module")
def hf(tiny_path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()


async def events_of(worker: DecodeWorker, req: DecodeRequest) -> list[TokenEvent]:
    return [ev async for ev in worker.generate(req)]


@pytest.mark.parametrize("chunk", [0, 16])
async def test_token_zero_carries_the_prompt_logprobs(tiny_path, ref_engine, hf, chunk: int) -> None:
    worker = make_colocated(tiny_path, chunk)
    rng = random.Random(chunk)
    prompt, other = random_prompt(rng, 45), random_prompt(rng, 30)
    await worker.start()
    try:
        asked, plain = await asyncio.wait_for(asyncio.gather(
            events_of(worker, DecodeRequest("asked", prompt, PARAMS, prompt_logprobs=3)),
            events_of(worker, DecodeRequest("plain", other, PARAMS))), 60)
    finally:
        await worker.stop()
    scores = asked[0].prompt_logprobs
    assert scores is not None and all(ev.prompt_logprobs is None for ev in asked[1:] + plain)
    assert_close(scores, hf_prompt_logprobs(hf, prompt, 3))
    assert [t for ev in asked for t in ev.token_ids] == reference(ref_engine, prompt, PARAMS)
    assert [t for ev in plain for t in ev.token_ids] == reference(ref_engine, other, PARAMS)
    assert worker.engine.pool.num_free_blocks == worker.engine.pool.num_blocks


async def test_disaggregated_decode_refuses_the_ask(tiny_path) -> None:
    from engine.config import EngineConfig
    from engine.engine import Engine
    from kv_transfer.handle import KVHandle
    from kv_transfer.layout import KVLayout

    eng = Engine.from_dir(tiny_path, EngineConfig(num_blocks=16))
    worker = DecodeWorker(eng, DecodeWorkerConfig(), importer=InProcessImporter())
    handle = KVHandle("t", "inproc", 1, 3, KVLayout.from_model(eng.model_config, "float32", 16), expires_at=0.0)
    req = DecodeRequest("x", (5, 6, 7), PARAMS, choices=(DecodeChoice(0, 8),), handle=handle,
                        prompt_logprobs=1)
    with pytest.raises(ValueError, match="prefill pool"):
        await events_of(worker, req)


def test_merged_events_keep_the_prompt_logprobs() -> None:
    scores = PromptLogprobs((-1.0,), (2,), ((4,),), ((-0.5,),))
    merged = merge_events([TokenEvent("r", (1,), prompt_logprobs=scores), TokenEvent("r", (2,))])
    assert merged.token_ids == (1, 2) and merged.prompt_logprobs == scores
