"""The prefill worker's prefix cache under a length-dependent RoPE (Phi-3 longrope past 48 tokens):
a prompt reuses a cached prefix only when its length picks the same table as the prompt that cached
it, and token 0 is transformers' either way (a reused block's keys were rotated by that table)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from engine.sampling.sampler import SamplingParams
from prefill_worker.types import PrefillRequest
from tests.support.inprocess_pd import make_pd, random_prompt
from tests.support.models import make_tiny

pytestmark = pytest.mark.timeout(240)

LONGROPE = {"rope_type": "longrope", "short_factor": [1.0 + 0.2 * i for i in range(8)],
            "long_factor": [1.0 + 2.0 * i for i in range(8)]}


async def test_prefix_reuse_only_within_one_rope_table(tmp_path: Path) -> None:
    import transformers

    path = make_tiny("phi3", tmp_path / "m", seed=4, eos_token_id=None, rope_scaling=LONGROPE,
                     max_position_embeddings=128, original_max_position_embeddings=48)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rng = random.Random(3)
    prefix = random_prompt(rng, 32)  # two blocks of 16
    # 38 and 42 tokens: the short factors; 62 and 72: the long ones (chunked by 16, every chunk long)
    prompts = [prefix + random_prompt(rng, n) for n in (6, 10, 30, 40)]
    pd = make_pd(path, max_batch_tokens=64, max_chunk_tokens=16)
    await pd.prefill.start()
    try:
        cached, tokens = [], []
        for i, p in enumerate(prompts):  # one after another: each finds what the ones before cached
            res = await pd.prefill.prefill(PrefillRequest(f"r{i}", p, SamplingParams(max_tokens=1)))
            cached.append(res.num_cached_tokens)
            tokens.append(res.choices[0].token_id)
    finally:
        await pd.prefill.stop()
    assert cached == [0, 32, 0, 32]  # the long prompt does not take the short one's prefix blocks
    with torch.no_grad():
        assert tokens == [int(hf(torch.tensor([list(p)])).logits[0, -1].argmax()) for p in prompts]
    assert pd.prefill.engine.pool.num_used_blocks == 0
