"""The device sampling path (engine/sampling/device.py) against the host path (numpy, the oracle
that test_sampling and test_sampling_draw hold to transformers and a brute-force sampler): the
same tokens, log-probs and top alternatives over random rows and parameter mixes, several steps
each (the penalty books and min_tokens move), on tie-free fp32 and tie-heavy bf16 logits, under
grammars; and the host reads nothing computed from the logits but the step's one `fetch`.

The rows are random fp32 (or bf16) logits, so no row's ``u * total`` or top-p goal lies within a
rounding of a boundary between two tokens: there the paths may differ (engine/sampling/device.py
says where). Where ties are many (bf16) both paths' rules are value-based, so ties cannot part them.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from engine.sampling import device
from engine.sampling.grammar import GrammarSpec, GrammarVocab, grammar_vocab, mask_logits
from engine.sampling.sampler import Sampled, SamplerState, SamplingParams, sample
from engine.tokenizer import Tokenizer
from tests.support.grammar_specs import SPEC

pytestmark = pytest.mark.timeout(120)


def random_params(rng: random.Random, vocab: int, grammar: GrammarSpec | None = None) -> SamplingParams:
    greedy = rng.random() < 0.2
    return SamplingParams(
        max_tokens=16, temperature=0.0 if greedy else rng.choice([0.3, 0.7, 1.0, 1.6]),
        seed=rng.choice([None, rng.randrange(10**6)]), top_k=rng.choice([0, 0, 1, 5, 50, vocab + 3]),
        top_p=rng.choice([1.0, 1.0, 0.95, 0.6, 0.1]), min_p=rng.choice([0.0, 0.0, 0.02, 0.3]),
        repetition_penalty=rng.choice([1.0, 1.0, 0.8, 1.4]), frequency_penalty=rng.choice([0.0, 0.6, -0.5]),
        presence_penalty=rng.choice([0.0, 0.4]), min_tokens=rng.choice([0, 0, 2]), stop_token_ids=(3,),
        logit_bias=tuple((rng.randrange(vocab + 8), rng.uniform(-100, 100)) for _ in range(rng.choice([0, 0, 2]))),
        logprobs=True, top_logprobs=rng.choice([0, 1, 5]), grammar=grammar,
    )


def both_paths(x: torch.Tensor, make: Callable[[], list[SamplerState]], steps: int, rng_seed: int,
               ) -> list[tuple[Sampled, Sampled]]:
    """``steps`` steps of the host path and of the device path, each over its own states; the
    default generator (unseeded rows' uniforms) reset alike before each step of each path."""
    host, dev = make(), make()
    out = []
    for step in range(steps):
        logits = x + step * 0.01 * torch.arange(x.shape[1])  # [B, V] a new row each step
        torch.manual_seed(rng_seed + step)
        a = sample(logits, host)
        torch.manual_seed(rng_seed + step)
        out.append((a, sample(logits, dev, on_device=True)))
    assert [st.output_ids for st in host] == [st.output_ids for st in dev]
    return out


def assert_same(a: Sampled, b: Sampled) -> None:
    assert a.token_ids == b.token_ids
    torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), atol=1e-5, rtol=0)
    assert [[t for t, _ in row] for row in a.top] == [[t for t, _ in row] for row in b.top]
    for ra, rb in zip(a.top, b.top, strict=True):
        assert all(abs(la - lb) <= 1e-5 for (_, la), (_, lb) in zip(ra, rb, strict=True))


@pytest.mark.parametrize(("vocab", "bf16"), [(64, False), (500, False), (500, True), (3000, False)])
def test_device_path_equals_host_path_over_random_mixes(vocab: int, bf16: bool) -> None:
    rng = random.Random(vocab + bf16)
    rows = 0
    for trial in range(12):
        b = rng.randrange(1, 9)
        x = torch.randn(b, vocab, generator=torch.Generator().manual_seed(trial)) * rng.choice([1.0, 3.0, 8.0])
        x = x.bfloat16().float() if bf16 else x  # bf16: a few hundred distinct values, many ties
        params = [random_params(rng, vocab) for _ in range(b)]
        prompts = [[rng.randrange(vocab) for _ in range(rng.randrange(8))] for _ in range(b)]
        outs = [[rng.randrange(vocab) for _ in range(rng.randrange(4))] for _ in range(b)]

        def make(params: list[SamplingParams] = params, prompts: list[list[int]] = prompts,
                 outs: list[list[int]] = outs) -> list[SamplerState]:
            return [SamplerState.new(p, pr, o, eos_ids=(2,)) for p, pr, o in zip(params, prompts, outs, strict=True)]

        for a, d in both_paths(x, make, steps=4, rng_seed=trial):
            assert_same(a, d)
        rows += b
    assert rows >= 40


def test_min_p_cut_is_exact_at_an_fp32_boundary() -> None:
    """min-p keeps ``x >= x_max + T * log(min_p)`` in exact arithmetic: a logit at that bound
    rounded down to fp32 lies below it and is dropped by both paths, in every draw."""
    min_p = next(m for m in (0.1, 0.2, 0.3, 0.4, 0.6, 0.7) if float(torch.tensor(math.log(m)).float()) < math.log(m))
    below = float(torch.tensor(math.log(min_p)).float())  # the fp32 value just under the bound
    x = torch.full((200, 16), -1e4)
    x[:, 0], x[:, 1], x[:, 2] = 0.0, below, math.log(min_p) + 1e-3  # [B, V]: max, just out, just in

    def make() -> list[SamplerState]:
        return [SamplerState.new(SamplingParams(temperature=1.0, min_p=min_p, seed=s)) for s in range(len(x))]

    (a, d), = both_paths(x, make, steps=1, rng_seed=0)
    assert a.token_ids == d.token_ids and 1 not in a.token_ids and {0, 2} <= set(a.token_ids)


@pytest.fixture(scope="module")
def vocab(smollm_dir: Path) -> GrammarVocab:
    return grammar_vocab(smollm_dir, Tokenizer.from_dir(smollm_dir).eos_token_ids)


def test_device_grammar_mask_equals_the_host_mask(vocab: GrammarVocab) -> None:
    for width in (vocab.size + 64, vocab.size - 7):  # a head wider and narrower than the tokenizer
        x = torch.randn(4, width, generator=torch.Generator().manual_seed(width))  # [B, V]
        states = [SamplerState.new(SamplingParams(grammar=g), vocab=vocab)
                  for g in (SPEC, None, GrammarSpec("json_object"), SPEC)]
        states[3].record(int(mask_logits(x, [st.grammar for st in states])[3].argmax()))  # a step further in
        matchers = [st.grammar for st in states]
        got = device.grammar_mask(x, matchers)
        assert torch.equal(got, mask_logits(x, matchers))
        assert torch.equal(device.grammar_mask(x[[0, 2]], [matchers[0], matchers[2]]), mask_logits(x[[0, 2]],
                                                                                                    matchers[::2]))
        assert device.grammar_mask(x, [None] * 4) is x


def test_device_path_equals_host_path_under_grammars(vocab: GrammarVocab) -> None:
    rng = random.Random(9)
    x = torch.randn(5, vocab.size, generator=torch.Generator().manual_seed(9)) * 4  # [B, V]
    grammars = [SPEC, None, GrammarSpec("json_object"), SPEC, None]
    params = [random_params(rng, vocab.size, g) for g in grammars]
    params[0] = SamplingParams(max_tokens=16, temperature=0.9, seed=1, top_p=0.9, grammar=SPEC, logprobs=True,
                               top_logprobs=3)  # one drawn row under a grammar, whatever the rng chose

    def make() -> list[SamplerState]:
        return [SamplerState.new(p, eos_ids=(2,), vocab=vocab) for p in params]

    for a, d in both_paths(x, make, steps=6, rng_seed=3):
        assert_same(a, d)


class Watched(torch.Tensor):
    """A tensor whose descendants log every read of their values by the host (and every op whose
    result's shape depends on them): on a GPU, each of these waits for the device."""

    reads: ClassVar[list[str]] = []
    HOST_READS = frozenset({"tolist", "item", "numpy", "cpu", "to", "__bool__", "__int__", "__float__", "__index__",
                            "__array__", "nonzero", "masked_select", "unique", "argwhere"})

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if name in cls.HOST_READS or (name == "__getitem__" and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in _flat(args[1:]))):
            cls.reads.append(name)
        return super().__torch_function__(func, types, args, kwargs or {})


def _flat(items: Any) -> list[Any]:
    return [y for i in items for y in (_flat(i) if isinstance(i, (tuple, list)) else [i])]


def test_the_device_path_reads_the_logits_on_the_host_once_per_step(vocab: GrammarVocab,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(4)
    grammars = [None, SPEC, None, None, GrammarSpec("json_object"), None]
    params = [random_params(rng, vocab.size, g) for g in grammars]
    params[2] = SamplingParams(temperature=0.8, seed=3, top_k=20, top_p=0.9, min_p=0.01, repetition_penalty=1.2,
                               frequency_penalty=0.3, logit_bias=((5, 2.0),), min_tokens=2, top_logprobs=4,
                               logprobs=True)  # every stage, whatever the rng chose
    states = [SamplerState.new(p, [7, 8, 9], eos_ids=(2,), vocab=vocab) for p in params]
    fetched: list[int] = []
    real_fetch = device.fetch

    def fetch(packed: torch.Tensor) -> list[list[float]]:
        fetched.append(len(Watched.reads))
        return real_fetch(packed.as_subclass(torch.Tensor))  # the one read the path is allowed

    monkeypatch.setattr(device, "fetch", fetch)
    Watched.reads.clear()
    x = torch.randn(len(params), vocab.size, generator=torch.Generator().manual_seed(4))  # [B, V]
    for step in range(3):
        out = sample((x + step).as_subclass(Watched), states, on_device=True)
        assert len(fetched) == step + 1 and Watched.reads == [], (step, Watched.reads)
        assert len(out.token_ids) == len(params)
    sample(x.as_subclass(Watched), [SamplerState.new(SamplingParams(temperature=1.0))] * len(params),
           on_device=False)
    assert Watched.reads, "the host path reads the logits: the watch sees such reads"


def test_sample_takes_the_device_path_for_logits_off_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str] = []

    def choose(x: torch.Tensor, states: list[SamplerState]) -> Sampled:
        seen.append(x.device.type)
        return Sampled([0] * len(states), [0.0] * len(states), [()] * len(states))

    monkeypatch.setattr(device, "choose", choose)
    states = [SamplerState.new(SamplingParams(temperature=1.0, seed=1))]
    sample(torch.zeros(1, 8), states)
    sample(torch.zeros(1, 8, device="meta"), states)
    sample(torch.zeros(1, 8), states, on_device=True)
    assert seen == ["meta", "cpu"] and states[0].output_ids[1:] == [0, 0]


@pytest.mark.gpu
def test_on_cuda_the_device_path_equals_the_host_path_without_waiting_on_the_device(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU: the same tokens as the host path on a CPU copy of the logits, and nothing but
    `fetch` synchronizes (torch's sync debug mode raises on any other wait)."""
    rng = random.Random(11)
    real_fetch = device.fetch

    def fetch(packed: torch.Tensor) -> list[list[float]]:
        torch.cuda.set_sync_debug_mode(0)
        try:
            return real_fetch(packed)
        finally:
            torch.cuda.set_sync_debug_mode("error")

    monkeypatch.setattr(device, "fetch", fetch)
    for trial in range(6):
        V = rng.choice([500, 32000, 128256])
        b = rng.randrange(1, 17)
        x = torch.randn(b, V, generator=torch.Generator().manual_seed(trial)) * 3  # [B, V]
        params = [random_params(rng, V) for _ in range(b)]
        host = [SamplerState.new(p, [1, 2, 3], eos_ids=(2,)) for p in params]
        dev = [SamplerState.new(p, [1, 2, 3], eos_ids=(2,)) for p in params]
        xc = x.cuda()
        for step in range(3):
            torch.manual_seed(step)
            a = sample(x + step, host)
            torch.manual_seed(step)
            torch.cuda.set_sync_debug_mode("error")
            try:
                d = sample(xc + step, dev)
            finally:
                torch.cuda.set_sync_debug_mode(0)
            assert_same(a, d)
