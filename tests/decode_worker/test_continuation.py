"""A continuation (a choice moved to another decode replica mid-stream, `router.migration`) goes on
exactly as the uninterrupted sequence: the oracle is the reference `generate()`, cut after ``k``
tokens and continued from the prompt plus those tokens, disaggregated (the prefill worker builds the
KV of the prompt and the sent tokens but the last) and colocated (the decode worker prefills them,
whole and in chunks). Greedy, seeded, penalties, ``min_tokens``, log-probs, a grammar (its matcher
replayed) and choice 1 of ``n = 2`` (its seed kept); the books are whole after each run."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path

import pytest

from decode_worker.types import DecodeChoice, DecodeRequest
from decode_worker.worker import DecodeWorker
from engine.config import EngineConfig
from engine.engine import Engine
from engine.generate import GenerateOutput, generate
from engine.sampling.choices import choice_params
from engine.sampling.grammar import GrammarSpec
from engine.sampling.sampler import SamplingParams
from engine.tokenizer import Tokenizer
from router.migration import continuation, continuation_prefill
from tests.support.grammar_specs import SCHEMA
from tests.support.inprocess_pd import EOS, PD, make_colocated, make_pd, random_prompt, wait_until
from tests.support.models import make_tiny_chat_model

pytestmark = pytest.mark.timeout(240)

PARAMS = [
    SamplingParams(max_tokens=20, ignore_eos=True),
    SamplingParams(max_tokens=20, ignore_eos=True, temperature=1.0, seed=5, top_k=40),
    SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.9, seed=11, frequency_penalty=0.8,
                   presence_penalty=0.4, repetition_penalty=1.3, logit_bias=((7, 3.0),)),
    SamplingParams(max_tokens=20, temperature=1.1, seed=12, min_tokens=14, min_p=0.05, top_p=0.9,
                   logit_bias=((EOS, 4.0),)),  # EOS likely, held back until min_tokens
    SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.8, seed=13, logprobs=True, top_logprobs=3),
]


async def continue_in(worker: DecodeWorker, pd: PD | None, rid: str, prompt: tuple[int, ...],
                      params: SamplingParams, index: int, sent: list[int]) -> tuple[list[int], list[float], str]:
    """Choice ``index`` continued after ``sent`` on ``worker`` (disaggregated: its KV from ``pd``'s
    prefill worker, as the router builds it): the tokens after ``sent``, their log-probs, the end."""
    handle = None
    if pd is not None:
        res = await pd.prefill.prefill(continuation_prefill(rid, prompt, sent))
        assert res.handle is not None and res.handle.n_tokens == len(prompt) + len(sent) - 1
        handle = res.handle
    tokens: list[int] = []
    lps: list[float] = []
    reason = ""
    async for ev in worker.generate(continuation(rid, prompt, params, index, sent, handle)):
        assert ev.error is None, ev.error
        tokens += ev.token_ids
        lps += ev.logprobs or ()
        reason = ev.finish_reason or reason
    return tokens, lps, reason


async def check_continuations(path: Path, cases: list[tuple[tuple[int, ...], SamplingParams, int]],
                              want: list[GenerateOutput], cuts: tuple[int, ...]) -> None:
    """Every case cut after each of ``cuts`` tokens, continued in every mode, equals ``want``."""
    pd = make_pd(path)
    colos = [make_colocated(path, chunk=c) for c in (0, 16)]
    workers: list[tuple[DecodeWorker, PD | None]] = [(pd.decode, pd), (colos[0], None), (colos[1], None)]
    for w in (pd.prefill, pd.decode, *colos):
        await w.start()
    try:
        jobs, expected = [], []
        for m, (worker, src) in enumerate(workers):
            for i, ((prompt, params, index), out) in enumerate(zip(cases, want, strict=True)):
                for k in cuts:
                    if k >= len(out.token_ids):
                        continue
                    jobs.append(continue_in(worker, src, f"m{m}-r{i}-k{k}", prompt, params, index,
                                            out.token_ids[:k]))
                    expected.append((out, k, params))
        got = await asyncio.gather(*jobs)
        for (tokens, lps, reason), (out, k, params) in zip(got, expected, strict=True):
            assert (tokens, reason) == (out.token_ids[k:], out.finish_reason)
            if params.logprobs:
                assert lps == pytest.approx(out.logprobs[k:], abs=1e-4)
        for worker, _ in workers:
            await wait_until(worker.is_idle)
            worker.scheduler.check_integrity()
            assert worker.engine.pool.num_free_blocks == worker.engine.pool.num_blocks
        assert pd.outbox.pending() == 0 and pd.prefill.engine.pool.num_used_blocks == 0
    finally:
        for w in (*colos, pd.decode, pd.prefill):
            await w.stop()


async def test_continuations_equal_the_uninterrupted_sequence(tiny_path: Path, ref_engine: Engine) -> None:
    rng = random.Random(34)
    cases = [(random_prompt(rng, n), p, 0) for n, p in zip((9, 16, 31, 40, 23), PARAMS, strict=True)]
    n2 = SamplingParams(max_tokens=20, ignore_eos=True, temperature=1.0, seed=21)
    cases += [(random_prompt(rng, 17), n2, 1)]  # choice 1 of n = 2: its derived seed, kept by its index
    want = [generate(ref_engine, prompt, choice_params(p, i), eos_token_ids=(EOS,)) for prompt, p, i in cases]
    assert want[3].finish_reason == "stop" and len(want[3].token_ids) > 14, "min_tokens held EOS back"
    await check_continuations(tiny_path, cases, want, cuts=(1, 2, 7, 14))


async def test_a_grammar_continues_with_its_matcher_replayed(tmp_path: Path) -> None:
    chat = make_tiny_chat_model(tmp_path / "chat", seed=13)
    tok = Tokenizer.from_dir(chat)
    prompt = tuple(tok.encode_chat([{"role": "user", "content": "Describe a person as JSON."}]))
    params = SamplingParams(max_tokens=60, temperature=1.0, seed=5,
                            grammar=GrammarSpec("json_schema", json.dumps(SCHEMA)))
    ref = Engine.from_dir(chat, EngineConfig(num_blocks=64, block_size=16))
    want = generate(ref, prompt, params, eos_token_ids=(EOS,))
    assert want.finish_reason == "stop" and len(want.token_ids) > 12
    await check_continuations(chat, [(prompt, params, 0)], [want], cuts=(1, 5, 12))


async def test_a_continuation_is_refused_where_it_cannot_be_exact(tiny_path: Path) -> None:
    prompt = random_prompt(random.Random(3), 12)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    with pytest.raises(ValueError, match="one choice alone"):
        DecodeRequest("two", prompt, params, choices=(DecodeChoice(0, 5, (6,)), DecodeChoice(1, 7)))
    with pytest.raises(ValueError, match="token 0"):
        DecodeChoice(0, None, (6,))
    colo = make_colocated(tiny_path, chunk=0)
    await colo.start()
    try:
        done = DecodeRequest("full", prompt, params, choices=(DecodeChoice(0, 5, (6, 7, 8)),))
        with pytest.raises(ValueError, match="leave nothing of max_tokens"):
            await colo.generate(done).__anext__()
        assert not colo.streams and colo.engine.pool.num_free_blocks == colo.engine.pool.num_blocks
    finally:
        await colo.stop()
