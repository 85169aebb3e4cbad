"""The prefill worker's prompt log-probs over a tiny model, against transformers: chunked among
plain prompts, never from the prefix cache (a cached prefix has no logits), yet published to it."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from engine.sampling.sampler import SamplingParams
from prefill_worker.types import PrefillRequest
from tests.support.inprocess_pd import make_pd, random_prompt, reference
from tests.support.prompt_logprobs_oracle import assert_close, hf_prompt_logprobs

pytestmark = pytest.mark.timeout(240)
ONE = SamplingParams(max_tokens=1, ignore_eos=True)  # token 0 only: nothing left for decode


@pytest.fixture(scope="module")
def hf(tiny_path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()


async def test_chunked_beside_plain_prompts_and_not_from_the_cache(tiny_path, ref_engine, hf) -> None:
    """A prompt whose full blocks another request just published: asked for its log-probs, it is
    prefilled whole (no cached tokens) in chunks of 16 beside plain prompts, and its entries are
    transformers'; the plain prompts' token 0 is the reference's, without log-probs attached."""
    pd = make_pd(tiny_path, max_batch_tokens=48, max_chunk_tokens=16)
    rng = random.Random(11)
    prompt = random_prompt(rng, 70)
    shorts = [random_prompt(rng, 12) for _ in range(3)]
    await pd.prefill.start()
    try:
        first = await pd.prefill.prefill(PrefillRequest("warm", prompt, ONE))
        assert first.prompt_logprobs is None
        again = await pd.prefill.prefill(PrefillRequest("hit", prompt, ONE))
        assert again.num_cached_tokens == 64  # the cache holds the prompt's full blocks
        asked, *plain = await asyncio.wait_for(asyncio.gather(
            pd.prefill.prefill(PrefillRequest("scored", prompt, ONE, prompt_logprobs=4)),
            *(pd.prefill.prefill(PrefillRequest(f"s{i}", p, ONE)) for i, p in enumerate(shorts))), 60)
    finally:
        await pd.prefill.stop()
    assert asked.num_cached_tokens == 0 and asked.timings.num_chunks == 5
    assert asked.prompt_logprobs is not None
    assert_close(asked.prompt_logprobs, hf_prompt_logprobs(hf, prompt, 4))
    assert asked.choices[0].token_id == reference(ref_engine, prompt, ONE)[0]
    for res, p in zip(plain, shorts, strict=True):
        assert res.prompt_logprobs is None and res.choices[0].token_id == reference(ref_engine, p, ONE)[0]
    assert pd.prefill.engine.pool.num_used_blocks == 0


async def test_a_scored_prompt_still_publishes_its_blocks(tiny_path, hf) -> None:
    pd = make_pd(tiny_path)
    prompt = random_prompt(random.Random(12), 40)
    await pd.prefill.start()
    try:
        asked = await pd.prefill.prefill(PrefillRequest("scored", prompt, ONE, prompt_logprobs=0))
        plain = await pd.prefill.prefill(PrefillRequest("plain", prompt, ONE))
        with pytest.raises(ValueError, match="prompt_logprobs"):
            await pd.prefill.prefill(PrefillRequest("bad", prompt, ONE, prompt_logprobs=21))
    finally:
        await pd.prefill.stop()
    assert asked.prompt_logprobs is not None
    assert_close(asked.prompt_logprobs, hf_prompt_logprobs(hf, prompt, 0))
    assert plain.num_cached_tokens == 32
