"""The sampler's per-sequence state across the pools: penalties, biases, min_tokens and seeds give the
same tokens disaggregated (token 0 on the prefill replica), colocated and in the reference
`generate()`, whatever the batch; repetition_penalty greedy equals transformers' ``generate``."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from decode_worker.types import DecodeChoice, DecodeRequest
from engine.engine import Engine
from engine.sampling.sampler import SamplingParams
from tests.support.inprocess_pd import make_colocated, make_pd, random_prompt, reference, run_both_modes

pytestmark = pytest.mark.timeout(240)

PARAMS = [
    SamplingParams(max_tokens=24, ignore_eos=True, repetition_penalty=1.3),
    SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.9, seed=11, frequency_penalty=0.8,
                   presence_penalty=0.4, top_k=20),
    SamplingParams(max_tokens=20, ignore_eos=True, temperature=1.1, seed=12, min_p=0.05, top_p=0.9,
                   repetition_penalty=1.2, logit_bias=((7, 3.0), (8, -100.0))),
    SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.7, seed=13),
    SamplingParams(max_tokens=16, ignore_eos=True),
]


def test_repetition_penalty_greedy_matches_transformers_generate(tiny_path: Path, ref_engine: Engine) -> None:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()
    prompt = list(random_prompt(random.Random(21), 30))
    for penalty in (1.3, 0.8):
        ours = reference(ref_engine, prompt, SamplingParams(max_tokens=24, ignore_eos=True,
                                                            repetition_penalty=penalty))
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None,
                              pad_token_id=0, repetition_penalty=penalty)[0, len(prompt):].tolist()
        assert ours == ref, penalty
    plain = reference(ref_engine, prompt, SamplingParams(max_tokens=24, ignore_eos=True))
    assert plain != reference(ref_engine, prompt, PARAMS[0])  # the penalty changed something


async def test_both_modes_match_the_reference_in_one_batch(tiny_path: Path, ref_engine: Engine) -> None:
    rng = random.Random(22)
    prompts = [random_prompt(rng, rng.randint(8, 70)) for _ in PARAMS]
    want = [reference(ref_engine, p, s) for p, s in zip(prompts, PARAMS, strict=True)]
    got, got_colo = await run_both_modes(tiny_path, prompts, PARAMS)
    assert [t for t, _ in got] == want
    assert [t for t, _ in got_colo] == want


async def test_min_tokens_holds_back_a_stop_token(tiny_path: Path, ref_engine: Engine) -> None:
    prompt = random_prompt(random.Random(23), 40)
    free_run = reference(ref_engine, prompt, SamplingParams(max_tokens=30, ignore_eos=True))
    stop = free_run[2]
    first = free_run.index(stop)
    params = SamplingParams(max_tokens=30, stop_token_ids=(stop,), min_tokens=first + 4)
    pd = make_pd(tiny_path)
    async with pd.running():
        tokens, _ = await pd.run("m1", prompt, params)
    assert tokens == reference(ref_engine, prompt, params)
    assert stop not in tokens[: first + 4] and len(tokens) > first + 4


async def _with_logprobs(pd, req_id: str, prompt: tuple[int, ...], params: SamplingParams):  # type: ignore[no-untyped-def]
    """tokens, chosen log-probs and top log-probs of a disaggregated run (token 0 from the prefill)."""
    from prefill_worker.types import PrefillRequest

    res = await pd.prefill.prefill(PrefillRequest(req_id, prompt, params))
    (first,) = res.choices
    tokens, lps, tops = [first.token_id], [first.logprob], [first.top_logprobs]
    req = DecodeRequest(req_id, prompt, params, choices=(DecodeChoice(0, first.token_id),), handle=res.handle)
    async for ev in pd.decode.generate(req):
        tokens.extend(ev.token_ids)
        lps.extend(ev.logprobs or ())
        tops.extend(ev.top_logprobs or ())
    return tokens, lps, tops


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
async def test_logprobs_are_transformers_log_softmax(tiny_path: Path, mode: str) -> None:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()
    prompt = random_prompt(random.Random(24), 25)
    params = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.8, seed=5, repetition_penalty=1.5,
                            logprobs=True, top_logprobs=5)
    if mode == "disaggregated":
        pd = make_pd(tiny_path)
        async with pd.running():
            tokens, lps, tops = await _with_logprobs(pd, "l1", prompt, params)
    else:
        colo = make_colocated(tiny_path, chunk=0)
        await colo.start()
        try:
            tokens, lps, tops = [], [], []
            async for ev in colo.generate(DecodeRequest("l2", prompt, params)):
                tokens.extend(ev.token_ids)
                lps.extend(ev.logprobs or ())
                tops.extend(ev.top_logprobs or ())
        finally:
            await colo.stop()
    with torch.no_grad():
        ref = hf(torch.tensor([list(prompt) + tokens])).logits[0, len(prompt) - 1 : -1].float().log_softmax(-1)
    assert len(tokens) == len(lps) == len(tops) == 8
    torch.testing.assert_close(torch.tensor(lps), ref.gather(1, torch.tensor(tokens)[:, None])[:, 0],
                               atol=1e-4, rtol=0)
    vals, idx = ref.topk(5, dim=-1)
    assert [[t for t, _ in top] for top in tops] == idx.tolist()
    torch.testing.assert_close(torch.tensor([[v for _, v in top] for top in tops]), vals, atol=1e-4, rtol=0)
