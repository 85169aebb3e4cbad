"""A disaggregated decode worker with ``local_prefill`` on: requests without a KV handle (the router's
LOCAL path) are prefilled here through the colocated code path, beside requests whose KV it pulls, and
every output equals the reference `generate()`; prompt log-probs on the local path equal
transformers'; a LOCAL request's continuation is prefilled here too; with ``local_prefill`` off a
handle-less request is refused, naming the setting."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from decode_worker.types import DecodeChoice, DecodeRequest
from engine.generate import generate
from engine.sampling.sampler import SamplingParams
from tests.support.inprocess_pd import collect, make_pd, random_prompt, reference, wait_until
from tests.support.prompt_logprobs_oracle import assert_close, hf_prompt_logprobs

pytestmark = pytest.mark.timeout(240)

GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.9, seed=5)


@pytest.mark.parametrize("chunk", [0, 16])
async def test_local_and_remote_requests_equal_the_reference(tiny_path, ref_engine, chunk: int) -> None:
    rng = random.Random(chunk + 1)
    jobs = [(random_prompt(rng, n), p) for n, p in ((12, GREEDY), (70, SEEDED), (33, GREEDY), (5, SEEDED))]
    pd = make_pd(tiny_path, local_prefill=True, local_chunk=chunk)
    async with pd.running():
        local = [collect(pd.decode, DecodeRequest(f"l{i}", prompt, p)) for i, (prompt, p) in enumerate(jobs)]
        remote = [pd.run(f"r{i}", prompt, p) for i, (prompt, p) in enumerate(jobs)]
        got = await asyncio.wait_for(asyncio.gather(*local, *remote), 120)
        await wait_until(pd.decode.is_idle)
        pd.decode.scheduler.check_integrity()
        assert pd.decode.engine.pool.num_free_blocks == pd.decode.engine.pool.num_blocks
    want = [reference(ref_engine, prompt, p) for prompt, p in jobs]
    local_out, remote_out = got[: len(jobs)], got[len(jobs):]
    for (tokens, reason, error), expected in zip(local_out, want, strict=True):
        assert (tokens, reason, error) == (expected, "length", None)
    for (tokens, reason), expected in zip(remote_out, want, strict=True):
        assert (tokens, reason) == (expected, "length")


async def test_local_prompt_logprobs_equal_transformers(tiny_path, ref_engine) -> None:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()
    prompt = random_prompt(random.Random(3), 40)
    pd = make_pd(tiny_path, local_prefill=True, local_chunk=16)
    async with pd.running():
        events = [ev async for ev in pd.decode.generate(DecodeRequest("lp", prompt, GREEDY, prompt_logprobs=2))]
    scores = events[0].prompt_logprobs
    assert scores is not None and all(ev.prompt_logprobs is None for ev in events[1:])
    assert_close(scores, hf_prompt_logprobs(hf, prompt, 2))
    assert [t for ev in events for t in ev.token_ids] == reference(ref_engine, prompt, GREEDY)


async def test_a_local_continuation_is_prefilled_here(tiny_path, ref_engine) -> None:
    """A LOCAL request's choice moved here after ``k`` tokens continues without a handle: the KV of the
    prompt and the sent tokens but the last is prefilled here, and the rest equals the whole run."""
    prompt = random_prompt(random.Random(9), 27)
    params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.8, seed=17)
    whole = generate(ref_engine, prompt, params).token_ids
    pd = make_pd(tiny_path, local_prefill=True, local_chunk=8)
    async with pd.running():
        moved = [DecodeRequest(f"c{k}", prompt, params, choices=(DecodeChoice(0, whole[0], tuple(whole[1:k])),))
                 for k in (1, 5, 11)]  # as `router.migration.continuation` builds them, without a handle
        outs = await asyncio.gather(*(collect(pd.decode, req) for req in moved))
        await wait_until(pd.decode.is_idle)
        assert pd.decode.engine.pool.num_free_blocks == pd.decode.engine.pool.num_blocks
    for k, (tokens, reason, error) in zip((1, 5, 11), outs, strict=True):
        assert (tokens, reason, error) == (list(whole[k:]), "length", None)


async def test_without_local_prefill_a_handle_less_request_is_refused(tiny_path) -> None:
    pd = make_pd(tiny_path)
    async with pd.running():
        with pytest.raises(ValueError, match="local_prefill"):
            await collect(pd.decode, DecodeRequest("x", (5, 6, 7), GREEDY))
        assert pd.decode.is_idle()
