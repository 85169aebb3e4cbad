"""Prefill worker → outbox → in-process importer → decode worker, in one process: every greedy output
equals the reference; stops, limits, aborts, preemption, lease expiry and stream grouping on the whole path."""

from __future__ import annotations

import asyncio
import random

import pytest

from decode_worker.types import DecodeRequest
from engine.errors import ContextLengthError
from engine.sampling.sampler import SamplingParams
from kv_transfer.errors import TransferError
from prefill_worker.types import PrefillRequest
from tests.support.inprocess_pd import (
    EOS,
    collect,
    decode_choices,
    make_colocated,
    make_pd,
    random_prompt,
    reference,
    wait_until,
    workload,
)

pytestmark = pytest.mark.timeout(240)


async def test_disaggregated_matches_reference(tiny_path, ref_engine) -> None:
    pd = make_pd(tiny_path, max_batch_tokens=256)
    await pd.prefill.start()
    await pd.decode.start()
    jobs = workload(1)

    async def one(i: int, delay: float, prompt: tuple[int, ...], k: int) -> tuple[list[int], str]:
        await asyncio.sleep(delay)
        return await pd.run(f"r{i}", prompt, SamplingParams(max_tokens=k, ignore_eos=True))

    try:
        outs = await asyncio.gather(*(one(i, *j) for i, j in enumerate(jobs)))
        for (_, prompt, k), (tokens, reason) in zip(jobs, outs, strict=True):
            assert tokens == reference(ref_engine, prompt, SamplingParams(max_tokens=k, ignore_eos=True))
            assert reason == "length"
        await wait_until(pd.decode.is_idle)
        assert pd.outbox.pending() == 0
        rep = pd.decode.load_report()  # the step counters /metrics exports: every token after token 0
        assert rep.steps > 0 and rep.step_seconds > 0 and rep.step_cpu_seconds > 0
        assert rep.step_sequences == sum(k - 1 for _, _, k in jobs)
        for pool in (pd.prefill.engine.pool, pd.decode.engine.pool):
            pool.check_integrity()
            assert pool.num_free_blocks == pool.num_blocks
        assert pd.prefill.engine.pool.num_used_blocks == 0
    finally:
        await pd.decode.stop()
        await pd.prefill.stop()


async def test_eos_stop_ids_and_max_tokens(tiny_path, ref_engine) -> None:
    pd = make_pd(tiny_path)
    async with pd.running():
        prompt = random_prompt(random.Random(5), 40)
        free_run = reference(ref_engine, prompt, SamplingParams(max_tokens=30, ignore_eos=True))
        # A stop id: the stream ends on the first occurrence of a token the free run produces.
        stop_tok = free_run[7]
        first = free_run.index(stop_tok)
        tokens, reason = await pd.run("s1", prompt, SamplingParams(max_tokens=30, stop_token_ids=(stop_tok,)))
        assert tokens == free_run[: first + 1] and reason == "stop"
        # EOS (unless ignore_eos) ends streams the same way: make EOS the stop via eos ids.
        pd.decode.eos_ids = pd.prefill.eos_ids = (stop_tok,)
        tokens, reason = await pd.run("s2", prompt, SamplingParams(max_tokens=30))
        assert tokens == free_run[: first + 1] and reason == "stop"
        tokens, reason = await pd.run("s3", prompt, SamplingParams(max_tokens=30, ignore_eos=True))
        assert tokens == free_run and reason == "length"
        pd.decode.eos_ids = pd.prefill.eos_ids = (EOS,)
        tokens, reason = await pd.run("s4", prompt, SamplingParams(max_tokens=1, ignore_eos=True))
        assert tokens == free_run[:1] and reason == "length"
        tokens, reason = await pd.run("s5", prompt, SamplingParams(max_tokens=5, ignore_eos=True))
        assert tokens == free_run[:5] and reason == "length"


async def test_prompt_over_context_is_refused(tiny_path) -> None:
    pd = make_pd(tiny_path)
    with pytest.raises(ContextLengthError, match="maximum context length is 1024"):
        await pd.prefill.prefill(PrefillRequest("x", tuple(range(3, 1003)), SamplingParams(max_tokens=100)))
    worker = make_colocated(tiny_path, 0)
    with pytest.raises(ContextLengthError):
        await collect(worker, DecodeRequest("y", tuple(range(3, 1003)), SamplingParams(max_tokens=100)))


async def test_abort_mid_stream_frees_blocks(tiny_path) -> None:
    pd = make_pd(tiny_path)
    async with pd.running():
        prompt = random_prompt(random.Random(9), 100)
        params = SamplingParams(max_tokens=60, ignore_eos=True)
        res = await pd.prefill.prefill(PrefillRequest("a1", prompt, params))
        gen = pd.decode.generate(DecodeRequest("a1", prompt, params, decode_choices(res), res.handle))
        got = 0
        async for ev in gen:
            got += len(ev.token_ids)
            if got == 5:
                break
        await gen.aclose()
        pool = pd.decode.engine.pool
        await wait_until(pd.decode.is_idle, timeout=2)
        assert pool.num_free_blocks == pool.num_blocks
        pool.check_integrity()


async def test_full_decode_pool_waits_and_swap_preserves_output(tiny_path, ref_engine) -> None:
    """A decode pool too small for everyone: requests wait (none dropped), swaps keep outputs exact."""
    pd = make_pd(tiny_path, decode_blocks=24, max_num_seqs=8)
    swap = pd.decode.swap_space
    storage = swap.buffer.untyped_storage().data_ptr()
    await pd.prefill.start()
    await pd.decode.start()
    rng = random.Random(11)
    jobs = [(random_prompt(rng, rng.randint(30, 120)), rng.randint(20, 60)) for _ in range(10)]
    try:
        outs = await asyncio.gather(
            *(pd.run(f"w{i}", p, SamplingParams(max_tokens=k, ignore_eos=True)) for i, (p, k) in enumerate(jobs))
        )
        for (prompt, k), (tokens, _) in zip(jobs, outs, strict=True):
            assert tokens == reference(ref_engine, prompt, SamplingParams(max_tokens=k, ignore_eos=True))
        assert pd.decode.num_swapped_out > 0, "the pool was small enough to force preemption"
        assert pd.decode.engine.pool.num_free_blocks == 24
        # every swap landed in the one host buffer allocated at start, and gave its slots back
        assert swap.buffer.device.type == "cpu" and swap.buffer.untyped_storage().data_ptr() == storage
        assert swap.num_free == swap.num_blocks
    finally:
        await pd.decode.stop()
        await pd.prefill.stop()


async def test_expired_lease_frees_outbox_and_import_fails(tiny_path) -> None:
    pd = make_pd(tiny_path, lease_s=0.2)
    async with pd.running():
        prompt = random_prompt(random.Random(3), 50)
        params = SamplingParams(max_tokens=10, ignore_eos=True)
        res = await pd.prefill.prefill(PrefillRequest("e1", prompt, params))
        assert pd.prefill.engine.pool.num_used_blocks > 0
        await wait_until(lambda: pd.outbox.pending() == 0, timeout=5)
        assert pd.prefill.engine.pool.num_used_blocks == 0
        req = DecodeRequest("e1", prompt, params, decode_choices(res), res.handle)
        tokens, reason, error = await collect(pd.decode, req)
        assert reason == "error" and error and ("expired" in error.lower() or "unknown" in error.lower())
        assert tokens == []
        # An unknown handle fails just as clearly.
        from dataclasses import replace

        bogus = replace(res.handle, transfer_id="nope")
        with pytest.raises(TransferError):
            await pd.decode.importer.pull(bogus, pd.decode.engine.cache, [0])
        await wait_until(pd.decode.is_idle, timeout=2)
        assert pd.decode.engine.pool.num_free_blocks == pd.decode.engine.pool.num_blocks


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
async def test_stream_interval_sends_tokens_in_groups_and_loses_none(tiny_path, ref_engine, mode: str) -> None:
    """``stream_interval=3``: the first event at once, then at least 3 tokens an event but the last;
    the tokens are the reference's, whatever the grouping."""
    rng = random.Random(5)
    prompt, k = random_prompt(rng, 40), 11
    params = SamplingParams(max_tokens=k, ignore_eos=True)
    if mode == "colocated":
        worker = make_colocated(tiny_path, chunk=0, stream_interval=3)
        req = DecodeRequest("s1", prompt, params)
        first: list[int] = []
        pd = None
    else:
        pd = make_pd(tiny_path, stream_interval=3)
        await pd.prefill.start()
        worker = pd.decode
        res = await pd.prefill.prefill(PrefillRequest("s1", prompt, params))
        req = DecodeRequest("s1", prompt, params, choices=decode_choices(res), handle=res.handle)
        first = [res.choices[0].token_id]
    await worker.start()
    try:
        sizes, tokens, reason = [], list(first), None
        async for ev in worker.generate(req):
            sizes.append(len(ev.token_ids))
            tokens.extend(ev.token_ids)
            reason = ev.finish_reason
        assert tokens == reference(ref_engine, prompt, params) and reason == "length"
        assert all(n >= 3 for n in sizes[1:-1]) and len(sizes) < k
    finally:
        await worker.stop()
        if pd is not None:
            await pd.prefill.stop()
