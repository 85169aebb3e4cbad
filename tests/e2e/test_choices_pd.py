"""``n`` choices through prefill worker → decode worker in one process, and colocated: one prefill,
the prompt's KV forked per choice. Oracle: the reference `generate()` — greedy choices all equal
it; a seeded choice ``i`` equals it with choice ``i``'s derived seed (`engine.sampling.choices`), so choice 0
equals the ``n = 1`` request. Prompts that end mid-block (copy-on-write) and on a block boundary;
a decode pool small enough to swap forks; aborts of all choices. After each run both pools' books
pass their integrity checks with every block free."""

from __future__ import annotations

import asyncio
import random

import pytest

from decode_worker.types import DecodeChoice, DecodeRequest
from decode_worker.worker import DecodeWorker
from engine.engine import Engine
from engine.sampling.choices import choice_params
from engine.sampling.sampler import SamplingParams
from tests.support.inprocess_pd import (
    PD,
    collect_choices,
    make_colocated,
    make_pd,
    random_prompt,
    reference,
    wait_until,
)

pytestmark = pytest.mark.timeout(240)

GREEDY = SamplingParams(max_tokens=20, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=20, ignore_eos=True, temperature=1.0, seed=5, top_k=40)


async def books_whole(*workers: DecodeWorker, pd: PD | None = None) -> None:
    for w in workers:
        await wait_until(w.is_idle)
        w.scheduler.check_integrity()
        assert w.engine.pool.num_free_blocks == w.engine.pool.num_blocks
    if pd is not None:
        assert pd.outbox.pending() == 0
        pd.prefill.engine.pool.check_integrity()
        assert pd.prefill.engine.pool.num_used_blocks == 0


async def run_modes(tiny_path, prompt: tuple[int, ...], params: SamplingParams, n: int, decode_blocks: int = 256
                    ) -> list[dict[int, list[int]]]:
    """The choices' tokens disaggregated, then colocated (prefilled whole, and in chunks of 16)."""
    pd = make_pd(tiny_path, decode_blocks=decode_blocks)
    colos = [make_colocated(tiny_path, chunk=c, blocks=decode_blocks) for c in (0, 16)]
    workers = [pd.prefill, pd.decode, *colos]
    for w in workers:
        await w.start()
    try:
        got, reasons = await pd.run_choices("d", prompt, params, n)
        outs = [got]
        for i, colo in enumerate(colos):
            req = DecodeRequest(f"c{i}", prompt, params, choices=tuple(DecodeChoice(k) for k in range(n)))
            got, more = await collect_choices(colo, req)
            outs.append(got)
            assert more == reasons
        assert sorted(reasons) == list(range(n))
        await books_whole(pd.decode, *colos, pd=pd)
        return outs
    finally:
        for w in reversed(workers):
            await w.stop()


@pytest.mark.parametrize("prompt_len", [37, 32])  # mid-block: each fork copies the partial block
async def test_greedy_choices_are_identical_and_equal_the_reference(tiny_path, ref_engine: Engine,
                                                                     prompt_len: int) -> None:
    prompt = random_prompt(random.Random(prompt_len), prompt_len)
    want = reference(ref_engine, prompt, GREEDY)
    for got in await run_modes(tiny_path, prompt, GREEDY, n=3):
        assert got == {0: want, 1: want, 2: want}


@pytest.mark.parametrize("prompt_len", [29, 48])
async def test_seeded_choices_follow_their_derived_seeds(tiny_path, ref_engine: Engine, prompt_len: int) -> None:
    prompt = random_prompt(random.Random(prompt_len), prompt_len)
    want = {i: reference(ref_engine, prompt, choice_params(SEEDED, i)) for i in range(3)}
    assert want[0] == reference(ref_engine, prompt, SEEDED)  # choice 0 is the n = 1 request
    assert len({tuple(t) for t in want.values()}) == 3  # the seeds differ, and so do the texts
    first, *others = await run_modes(tiny_path, prompt, SEEDED, n=3)
    assert first == want
    assert all(o == want for o in others)  # reproducible, whichever process sampled what


async def test_choices_end_on_their_own_and_free_their_blocks(tiny_path, ref_engine: Engine) -> None:
    """A stop id that ends one choice early: that choice finishes (its blocks freed, the shared ones
    kept for the others) while the others run on, each equal to its reference."""
    prompt = random_prompt(random.Random(12), 37)
    free_run = {i: reference(ref_engine, prompt, choice_params(SEEDED, i)) for i in range(3)}
    stop = next(t for t in free_run[1][1:6] if t not in free_run[0] and t not in free_run[2])
    params = SamplingParams(max_tokens=20, ignore_eos=True, temperature=1.0, seed=5, top_k=40, stop_token_ids=(stop,))
    want = {i: reference(ref_engine, prompt, choice_params(params, i)) for i in range(3)}
    assert len(want[1]) < 20 and len(want[0]) == len(want[2]) == 20
    for got in await run_modes(tiny_path, prompt, params, n=3):
        assert got == want


async def test_forks_swapped_under_pressure_still_equal_the_reference(tiny_path, ref_engine: Engine) -> None:
    """10 blocks of 16 tokens: 4 choices of a 40-token prompt growing by 60 tokens each need 28
    unshared blocks, so forks are swapped out (with blocks their siblings share) and back in."""
    prompt = random_prompt(random.Random(9), 40)
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    want = reference(ref_engine, prompt, params)
    pd = make_pd(tiny_path, decode_blocks=10)
    async with pd.running():
        got, reasons = await pd.run_choices("p", prompt, params, n=4)
        assert got == dict.fromkeys(range(4), want) and reasons == dict.fromkeys(range(4), "length")
        assert pd.decode.num_swapped_out > 0
        await books_whole(pd.decode, pd=pd)


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
async def test_closing_the_stream_aborts_every_choice_and_frees_each_block_once(tiny_path, mode: str) -> None:
    prompt = random_prompt(random.Random(3), 37)
    params = SamplingParams(max_tokens=200, ignore_eos=True, temperature=0.9)
    pd = make_pd(tiny_path)
    colo = make_colocated(tiny_path, chunk=0)
    workers = [pd.prefill, pd.decode, colo]
    for w in workers:
        await w.start()
    try:
        if mode == "colocated":
            worker = colo
            req = DecodeRequest("a", prompt, params, choices=tuple(DecodeChoice(i) for i in range(4)))
        else:
            from prefill_worker.types import PrefillRequest

            worker = pd.decode
            res = await pd.prefill.prefill(PrefillRequest("a", prompt, params, n=4))
            choices = tuple(DecodeChoice(i, ft.token_id) for i, ft in enumerate(res.choices))
            req = DecodeRequest("a", prompt, params, handle=res.handle, choices=choices)
        seen: set[int] = set()
        gen = worker.generate(req)
        async for ev in gen:
            seen.add(ev.index)
            if len(seen) == 4 and worker.scheduler.num_running == 4:
                break
        await gen.aclose()
        assert seen == {0, 1, 2, 3}
        await books_whole(worker, pd=pd)
        assert not worker.groups and not worker.streams
    finally:
        for w in reversed(workers):
            await w.stop()


async def test_a_lost_kv_ends_every_choice_with_kv_lost(tiny_path) -> None:
    from decode_worker.types import KV_LOST
    from prefill_worker.types import PrefillRequest

    pd = make_pd(tiny_path, lease_s=0.2)
    async with pd.running():
        prompt = random_prompt(random.Random(6), 50)
        params = SamplingParams(max_tokens=10, ignore_eos=True)
        res = await pd.prefill.prefill(PrefillRequest("k", prompt, params, n=3))
        await wait_until(lambda: pd.outbox.pending() == 0, timeout=5)  # the lease ran out: KV gone
        choices = tuple(DecodeChoice(i, ft.token_id) for i, ft in enumerate(res.choices))
        events = [ev async for ev in pd.decode.generate(DecodeRequest("k", prompt, params, handle=res.handle,
                                                                      choices=choices))]
        assert sorted(ev.index for ev in events) == [0, 1, 2]
        assert all(ev.finish_reason == "error" and ev.error_code == KV_LOST and not ev.token_ids for ev in events)
        await books_whole(pd.decode, pd=pd)


async def test_choices_run_beside_other_requests(tiny_path, ref_engine: Engine) -> None:
    """Several requests of 1-3 choices at once in one decode batch: each choice still equals its
    reference, so forks never read or write another sequence's blocks."""
    rng = random.Random(4)
    jobs = [(random_prompt(rng, rng.randint(5, 70)), rng.randint(1, 3), rng.randint(1, 24)) for _ in range(8)]
    pd = make_pd(tiny_path, decode_blocks=64)
    async with pd.running():
        outs = await asyncio.gather(*(
            pd.run_choices(f"r{i}", p, SamplingParams(max_tokens=k, ignore_eos=True, temperature=0.8, seed=i), n)
            for i, (p, n, k) in enumerate(jobs)))
        for i, ((p, n, k), (got, _)) in enumerate(zip(jobs, outs, strict=True)):
            params = SamplingParams(max_tokens=k, ignore_eos=True, temperature=0.8, seed=i)
            assert got == {c: reference(ref_engine, p, choice_params(params, c)) for c in range(n)}
        await books_whole(pd.decode, pd=pd)


async def test_choices_under_a_grammar_each_follow_their_own_matcher(tmp_path_factory: pytest.TempPathFactory
                                                                     ) -> None:
    """A JSON-schema grammar and 3 seeded choices: each choice's matcher is its own (token 0 on the
    prefill worker, rebuilt on decode; colocated), each equal to the reference with its seed."""
    import json

    from engine.config import EngineConfig
    from engine.generate import generate
    from engine.sampling.grammar import GrammarSpec
    from engine.tokenizer import Tokenizer
    from tests.support.inprocess_pd import EOS
    from tests.support.models import make_tiny_chat_model

    path = make_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat-choices"), seed=13)
    schema = {"type": "object", "properties": {"name": {"enum": ["ann", "bob"]}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=9,
                            grammar=GrammarSpec("json_schema", json.dumps(schema)))
    prompt = tuple(Tokenizer.from_dir(path).encode_chat([{"role": "user", "content": "A person as JSON."}]))
    ref = Engine.from_dir(path, EngineConfig(num_blocks=64, block_size=16))
    want = {i: generate(ref, prompt, choice_params(params, i), eos_token_ids=(EOS,)).token_ids for i in range(3)}
    assert len({tuple(t) for t in want.values()}) > 1  # the seeds pick different answers
    for got in await run_modes(path, prompt, params, n=3):
        assert got == want

