"""The other model families served end to end in one process, disaggregated and colocated (chunked):
greedy tokens equal transformers' `generate` on tiny random models whose sliding window is shorter
than the prompts, so the window is applied in prefill, in chunks after a prefix, and in decode; and
whose length-dependent RoPE changes table within the prompts' range (longrope past 64 tokens: a
prompt below it that crosses it while decoding, prompts above it prefilled in chunks)."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
import torch

from decode_worker.types import DecodeRequest
from engine.sampling.sampler import SamplingParams
from tests.support.inprocess_pd import collect, make_colocated, make_pd, random_prompt
from tests.support.models import make_tiny

pytestmark = pytest.mark.timeout(300)

MODELS = {
    "qwen3-window": ("qwen3", {"use_sliding_window": True, "sliding_window": 24, "max_window_layers": 1}),
    "mistral-window": ("mistral", {"sliding_window": 20}),
    # local / global layers alternating; Gemma 2's attention and final soft-caps; Gemma 3's local RoPE base
    "gemma2-window": ("gemma2", {"sliding_window": 20}),
    "gemma3-window": ("gemma3", {"sliding_window": 24}),
    # Phi-4-mini's shape: longrope over the first 3/4 of each head (12 of 16 dims: 6 factors each)
    "phi4mini-longrope": ("phi3", {"partial_rotary_factor": 0.75, "max_position_embeddings": 256,
                                   "original_max_position_embeddings": 64,
                                   "rope_scaling": {"rope_type": "longrope",
                                                    "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                                                    "long_factor": [1.0, 2.0, 4.0, 6.0, 8.0, 10.0]}}),
}
PROMPTS = (30, 75, 140)  # tokens; each longer than the window, one beyond a 64-token chunk twice
NEW = 48  # greedy positions compared per prompt


@pytest.fixture(scope="module", params=sorted(MODELS))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list]:
    import transformers

    fam, overrides = MODELS[request.param]
    path = make_tiny(fam, tmp_path_factory.mktemp(request.param), seed=5, eos_token_id=None, **overrides)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rng = random.Random(9)
    cases = []
    for n in PROMPTS:
        prompt = random_prompt(rng, n)
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, n:].tolist()
        cases.append((prompt, ref))
    return path, cases


async def test_disaggregated_greedy_equals_transformers(family) -> None:
    path, cases = family
    pd = make_pd(path, max_batch_tokens=64, max_chunk_tokens=64)
    async with pd.running():
        params = SamplingParams(max_tokens=NEW, ignore_eos=True)
        outs = await asyncio.gather(*(pd.run(f"r{i}", p, params) for i, (p, _) in enumerate(cases)))
        assert [tokens for tokens, _ in outs] == [ref for _, ref in cases]


async def test_colocated_chunked_greedy_equals_transformers(family) -> None:
    path, cases = family
    worker = make_colocated(path, chunk=64)
    await worker.start()
    try:
        params = SamplingParams(max_tokens=NEW, ignore_eos=True)
        outs = await asyncio.gather(*(collect(worker, DecodeRequest(f"c{i}", p, params))
                                      for i, (p, _) in enumerate(cases)))
        assert [tokens for tokens, _, _ in outs] == [ref for _, ref in cases]
    finally:
        await worker.stop()
