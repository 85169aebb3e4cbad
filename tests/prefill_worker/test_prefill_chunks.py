"""The prefill worker's chunked prefill over a tiny model: with a chunk cap, short prompts queued
behind a long one get token 0 first; token 0 is the reference's either way."""

from __future__ import annotations

import asyncio
import random

import pytest

from engine.sampling.sampler import SamplingParams
from tests.support.inprocess_pd import make_pd, random_prompt, reference

pytestmark = pytest.mark.timeout(240)


@pytest.mark.parametrize("cap", [64, None])
async def test_short_prompts_pass_a_long_one_between_its_chunks(tiny_path, ref_engine, cap: int | None) -> None:
    """With a chunk cap, chat-sized prompts queued behind a long one get token 0 first; without, they
    wait for its last chunk. Token 0 is the reference's either way."""
    from prefill_worker.types import PrefillRequest

    pd = make_pd(tiny_path, max_batch_tokens=256, max_chunk_tokens=cap)
    rng = random.Random(5)
    long = random_prompt(rng, 600)
    shorts = [random_prompt(rng, 20) for _ in range(3)]
    params = SamplingParams(max_tokens=1, ignore_eos=True)  # token 0 only: nothing left for decode
    done: list[str] = []

    async def one(rid: str, prompt: tuple[int, ...]) -> tuple[str, int, int]:
        res = await pd.prefill.prefill(PrefillRequest(rid, prompt, params))
        done.append(rid)
        return rid, res.choices[0].token_id, res.timings.num_chunks

    tasks = [asyncio.ensure_future(one("long", long))] + [
        asyncio.ensure_future(one(f"s{i}", p)) for i, p in enumerate(shorts)]
    await asyncio.sleep(0)  # all four queued, the long one first, before the step loop runs
    await pd.prefill.start()
    try:
        out = {rid: (tok, n) for rid, tok, n in await asyncio.wait_for(asyncio.gather(*tasks), 60)}
    finally:
        await pd.prefill.stop()
    for rid, prompt in [("long", long)] + [(f"s{i}", p) for i, p in enumerate(shorts)]:
        assert out[rid][0] == reference(ref_engine, prompt, params)[0]
    if cap is None:
        assert done[0] == "long" and out["long"][1] == 3  # 256 + 256 + 88: the shorts ride its last step
    else:
        assert done[-1] == "long" and out["long"][1] == -(-600 // cap)  # ten chunks of ≤ 64
        assert all(out[f"s{i}"][1] == 1 for i in range(3))
    assert pd.prefill.engine.pool.num_used_blocks == 0 and pd.outbox.pending() == 0
    report = pd.prefill.load_report()  # the measured prefill rate's counters: every prompt token computed once
    assert report.prefill_tokens == 600 + 3 * 20 and report.prefill_seconds > 0
