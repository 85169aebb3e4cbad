"""The other model families served end to end in one process, disaggregated and colocated (chunked):
greedy tokens equal transformers' `generate` on tiny random models whose sliding window is shorter
than the prompts, so the window is applied in prefill, in chunks after a prefix, and in decode."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
import torch

from decode_worker.types import DecodeRequest
from engine.sampling import SamplingParams
from tests.support.inprocess_pd import collect, make_colocated, make_pd, random_prompt
from tests.support.models import make_tiny

pytestmark = pytest.mark.timeout(300)

MODELS = {
    "qwen3-window": ("qwen3", {"use_sliding_window": True, "sliding_window": 24, "max_window_layers": 1}),
    "mistral-window": ("mistral", {"sliding_window": 20}),
    # local / global layers alternating; Gemma 2's attention and final soft-caps; Gemma 3's local RoPE base
    "gemma2-window": ("gemma2", {"sliding_window": 20}),
    "gemma3-window": ("gemma3", {"sliding_window": 24}),
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
    await pd.prefill.start()
    await pd.decode.start()
    try:
        params = SamplingParams(max_tokens=NEW, ignore_eos=True)
        outs = await asyncio.gather(*(pd.run(f"r{i}", p, params) for i, (p, _) in enumerate(cases)))
        assert [tokens for tokens, _ in outs] == [ref for _, ref in cases]
    finally:
        await pd.decode.stop()
        await pd.prefill.stop()


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
