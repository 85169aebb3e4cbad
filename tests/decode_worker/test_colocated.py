"""The colocated decode worker (it prefills too) over a tiny model: outputs equal the reference, and
a client gone mid-prefill frees its blocks."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from decode_worker.types import DecodeRequest
from engine.sampling.sampler import SamplingParams
from tests.support.inprocess_pd import collect, make_colocated, random_prompt, reference, wait_until, workload

pytestmark = pytest.mark.timeout(240)


@pytest.mark.parametrize("chunk", [0, 64])
async def test_colocated_matches_reference(tiny_path, ref_engine, chunk: int) -> None:
    worker = make_colocated(tiny_path, chunk)
    await worker.start()
    jobs = workload(2)

    async def one(i: int, delay: float, prompt: tuple[int, ...], k: int) -> list[int]:
        await asyncio.sleep(delay)
        tokens, reason, _ = await collect(
            worker, DecodeRequest(f"c{i}", prompt, SamplingParams(max_tokens=k, ignore_eos=True))
        )
        assert reason == "length"
        return tokens

    try:
        outs = await asyncio.gather(*(one(i, *j) for i, j in enumerate(jobs)))
        for (_, prompt, k), tokens in zip(jobs, outs, strict=True):
            assert tokens == reference(ref_engine, prompt, SamplingParams(max_tokens=k, ignore_eos=True))
        await wait_until(worker.is_idle)
        worker.engine.pool.check_integrity()
        assert worker.engine.pool.num_free_blocks == worker.engine.pool.num_blocks
    finally:
        await worker.stop()


@pytest.mark.parametrize("chunk", [0, 64])
async def test_colocated_abort_during_prefill_frees_blocks(tiny_path, ref_engine, chunk: int) -> None:
    """A client gone before token 0, while its prompt is being prefilled: blocks freed, worker healthy."""
    worker = make_colocated(tiny_path, chunk)
    runner = worker.engine.runner
    fast_prefill = runner.prefill

    def slow_prefill(*args, **kwargs):  # widen the window in which the prompt is mid-prefill
        time.sleep(0.3)
        return fast_prefill(*args, **kwargs)

    runner.prefill = slow_prefill  # type: ignore[method-assign]
    await worker.start()
    try:
        prompt = random_prompt(random.Random(21), 600)
        gen = worker.generate(DecodeRequest("gone", prompt, SamplingParams(max_tokens=8, ignore_eos=True)))
        first = asyncio.ensure_future(gen.__anext__())
        await wait_until(lambda: bool(worker.prefilling), timeout=5)
        first.cancel()
        with pytest.raises((asyncio.CancelledError, StopAsyncIteration)):
            await first
        await gen.aclose()
        await wait_until(worker.is_idle, timeout=5)
        assert worker.engine.pool.num_free_blocks == worker.engine.pool.num_blocks
        params = SamplingParams(max_tokens=6, ignore_eos=True)
        tokens, reason, _ = await collect(worker, DecodeRequest("next", prompt[:50], params))
        assert tokens == reference(ref_engine, prompt[:50], params) and reason == "length"
    finally:
        await worker.stop()
