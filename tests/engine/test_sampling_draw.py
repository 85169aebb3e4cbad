"""The truncation and the draw (engine/sampling/draw.py, through `truncate` and `sample`) against
their references: transformers' logits warpers for the kept sets, and a brute-force per-row sampler
written token by token with the same seeding: the same tokens in any batch, on tie-free and on
bf16 logits (many ties), and draws that follow the truncated distribution (no model)."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from engine.sampling import draw as sampling_draw
from engine.sampling.draw import BLOCK, _invert, truncate
from engine.sampling.sampler import SamplerState, SamplingParams, sample

pytestmark = pytest.mark.timeout(120)
V = 50
NEG = float("-inf")


def logits(b: int, seed: int = 0, vocab: int = V) -> torch.Tensor:
    return torch.randn(b, vocab, generator=torch.Generator().manual_seed(seed)) * 3  # [B, V]


def kept(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """x: [B, V] → [B, V] bool, the tokens `truncate` leaves each row."""
    a = x.numpy()
    return torch.from_numpy(a >= truncate(a, params)[:, None])


WARPERS = [
    ("top_k", [1, 5, 17], TopKLogitsWarper),
    ("top_p", [0.1, 0.5, 0.93], TopPLogitsWarper),
    ("min_p", [0.01, 0.2, 0.8], MinPLogitsWarper),
]


@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize(("name", "values", "warper"), WARPERS)
def test_truncation_matches_transformers_row_by_row(name: str, values: list[float], warper: type,
                                                    temperature: float) -> None:
    x = logits(len(values), seed=3)
    got = kept(x, [SamplingParams(temperature=temperature, **{name: v}) for v in values])
    for row, v in enumerate(values):
        ref = warper(v)(None, TemperatureLogitsWarper(temperature)(None, x[row : row + 1].clone()))[0]
        assert torch.equal(got[row], ~torch.isinf(ref)), (name, v)


COMBOS = [dict(min_p=0.01, top_k=30, top_p=0.9), dict(min_p=0.001, top_p=0.97), dict(top_k=3, top_p=0.999),
          dict(top_k=40, top_p=0.8), dict(min_p=0.3, top_p=0.5), dict(top_p=0.99), dict(top_k=12)]
EVERY_ROW_MIN_P = [dict(min_p=0.01, top_k=30, top_p=0.9), dict(min_p=0.001, top_p=0.97), dict(min_p=0.3, top_p=0.5),
                   dict(min_p=0.02, top_k=45), dict(min_p=0.05, top_k=2, top_p=0.7)]  # cuts from min-p's survivors


@pytest.mark.parametrize("combos", [COMBOS, EVERY_ROW_MIN_P])
@pytest.mark.parametrize("head", [4, 16, 2048])  # 4: most cuts lie past the head; 2048: past V
def test_combined_truncation_follows_the_warpers_in_order(combos: list[dict[str, float]], head: int,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sampling_draw, "HEAD", head)
    x = logits(len(combos), seed=12) * torch.linspace(0.1, 1.5, len(combos))[:, None]
    params = [SamplingParams(temperature=0.8, **c) for c in combos]  # type: ignore[arg-type]
    got = kept(x, params)
    for row, p in enumerate(params):
        ref = TemperatureLogitsWarper(p.temperature)(None, x[row : row + 1].clone())
        ref = MinPLogitsWarper(p.min_p)(None, ref) if p.min_p else ref
        ref = TopKLogitsWarper(p.top_k)(None, ref) if p.top_k else ref
        ref = TopPLogitsWarper(p.top_p)(None, ref)[0]
        assert torch.equal(got[row], ~torch.isinf(ref)), (head, p)


def test_top_k_keeps_ties_as_transformers_does() -> None:
    x = torch.tensor([[1.0, 3.0, 2.0, 2.0, 0.0] + [-5.0] * (V - 5)])
    got = kept(x, [SamplingParams(temperature=1.0, top_k=2)])
    ref = TopKLogitsWarper(2)(None, x.clone())
    assert torch.equal(got, ~torch.isinf(ref)) and int(got.sum()) == 3


def test_top_p_keeps_every_token_tied_with_its_last() -> None:
    x = torch.tensor([[4.0, 2.0, 2.0, 2.0, 1.0] + [-9.0] * (V - 5)])  # the nucleus ends among the 2.0s
    got = kept(x, [SamplingParams(temperature=1.0, top_p=0.9)])[0]
    assert got[:4].all() and not got[4:].any()


def reference_row(raw: torch.Tensor, st: SamplerState) -> int:
    """One row, the pipeline written out token by token (engine/sampling/sampler.py's docstring order):
    top-k and top-p keep every token tied with their last, and the draw walks the kept tokens in
    id order until their running weight passes the step generator's number times their total."""
    p = st.params
    vocab = len(raw)
    x = raw.clone().tolist()
    for tid, b in p.logit_bias:
        x[tid] += b
    if st.step < p.min_tokens:
        for tid in st.min_tokens_mask_ids:
            x[tid] = NEG
    seen = set(st.prompt_ids) | set(st.output_ids)
    for j in range(vocab):
        if j in seen and p.repetition_penalty != 1.0:
            x[j] = x[j] * p.repetition_penalty if x[j] < 0 else x[j] / p.repetition_penalty
        c = st.output_ids.count(j)
        x[j] -= c * p.frequency_penalty + (p.presence_penalty if c else 0.0)
    if p.greedy:
        return max(range(vocab), key=lambda j: x[j])  # the first of equal maxima
    x = [v / p.temperature for v in x]
    if p.min_p > 0:  # p_j >= min_p * p_max  <=>  x_j >= x_max + log(min_p)
        x = [v if v >= max(x) + math.log(p.min_p) else NEG for v in x]
    if 0 < p.top_k < vocab:
        kth = sorted(x, reverse=True)[p.top_k - 1]
        x = [v if v >= kth else NEG for v in x]
    if p.top_p < 1:
        total = sum(math.exp(v - max(x)) for v in x)
        mass, last = 0.0, max(x)
        for v in sorted(x, reverse=True):
            if mass >= p.top_p * total:
                break
            last, mass = v, mass + math.exp(v - max(x))
        x = [v if v >= last else NEG for v in x]
    gen = st.generator()
    assert gen is not None
    u = float(torch.rand(1, generator=gen, dtype=torch.float64)[0])
    cand = [j for j in range(vocab) if x[j] > NEG]
    running = list(itertools.accumulate(math.exp(x[j] - max(x)) for j in cand))
    return next(j for j, r in zip(cand, running, strict=True) if r > u * running[-1])


PARAMS = [
    SamplingParams(),
    SamplingParams(temperature=0.8, seed=1),
    SamplingParams(temperature=1.2, seed=2, top_k=7, top_p=0.9),
    SamplingParams(temperature=0.7, seed=3, min_p=0.1, repetition_penalty=1.4),
    SamplingParams(repetition_penalty=1.8, frequency_penalty=0.5, presence_penalty=0.3),
    SamplingParams(temperature=1.0, seed=4, frequency_penalty=-0.5, logit_bias=((11, 5.0),), min_tokens=4,
                   stop_token_ids=(0, 1)),
    SamplingParams(temperature=0.5, seed=5, top_p=0.3, min_p=0.05),
    SamplingParams(temperature=1.5, seed=6, top_p=0.95, min_p=0.001),
    SamplingParams(temperature=0.9, seed=7, top_k=40, top_p=0.97),  # widens the batch's head past HEAD
]


@pytest.mark.parametrize(("vocab", "head", "bf16"), [(V, 2048, False), (V, 4, False), (600, 16, True),
                                                      (600, 2048, True)])
def test_batched_sampler_equals_brute_force_rows_and_ignores_its_batch(
        vocab: int, head: int, bf16: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sampling_draw, "HEAD", head)
    rng = random.Random(6)
    for step in range(5):
        x = logits(len(PARAMS), seed=10 + step, vocab=vocab)
        x = x.bfloat16().float() if bf16 else x  # bf16 logits: a few hundred distinct values, many ties
        prompts = [[rng.randrange(vocab) for _ in range(5)] for _ in PARAMS]
        outs = [[rng.randrange(vocab) for _ in range(step)] for _ in PARAMS]

        def states(order: list[int], prompts: list[list[int]] = prompts, outs: list[list[int]] = outs,
                   ) -> list[SamplerState]:
            return [SamplerState.new(PARAMS[i], prompts[i], outs[i], eos_ids=(2,)) for i in order]

        rows = list(range(len(PARAMS)))
        want = [reference_row(x[i], st) for i, st in zip(rows, states(rows), strict=True)]
        batch = states(rows)
        got, lps, _ = sample(x, batch)
        assert got == want, step
        flipped = sample(x.flip(0), states(rows[::-1]))[0][::-1]  # another batch order
        for i, p in enumerate(PARAMS):
            alone = sample(x[i : i + 1], states([i]))[0]
            assert (alone == [got[i]] and flipped[i] == got[i]) or (p.seed is None and not p.greedy)
        torch.testing.assert_close(torch.tensor(lps), x.log_softmax(-1).gather(1, torch.tensor(got)[:, None])[:, 0])
        assert all(st.output_ids[-1] == t for st, t in zip(batch, got, strict=True))


def test_seeded_draws_follow_the_truncated_distribution() -> None:
    n = 4000
    x = logits(1, seed=13)
    params = [SamplingParams(temperature=0.7, top_k=8, top_p=0.9, seed=s) for s in range(n)]
    got = torch.tensor(sample(x.repeat(n, 1), [SamplerState.new(p) for p in params])[0])
    ref = TopPLogitsWarper(0.9)(None, TopKLogitsWarper(8)(None, TemperatureLogitsWarper(0.7)(None, x.clone())))
    freq = torch.bincount(got, minlength=V).float() / n
    assert bool((freq[torch.isinf(ref[0])] == 0).all())  # never a token the truncation removed
    torch.testing.assert_close(freq, ref[0].softmax(-1), atol=0.025, rtol=0)


def test_unseeded_draws_follow_the_distribution() -> None:
    x = torch.tensor([[2.0, 1.0, 0.0, -1.0] + [-30.0] * (V - 4)]).repeat(20000, 1)
    states = [SamplerState.new(SamplingParams(temperature=1.0)) for _ in range(len(x))]
    got = torch.tensor(sample(x, states)[0])
    freq = torch.bincount(got, minlength=V)[:4].float() / len(got)
    torch.testing.assert_close(freq, x[0, :4].softmax(-1) / x[0].softmax(-1)[:4].sum(), atol=0.015, rtol=0)


def test_whole_vocabulary_draws_follow_the_distribution_across_blocks() -> None:
    n, vocab = 4000, 4 * BLOCK + 37  # no truncation: the draw walks block sums, then one block
    x = torch.full((1, vocab), -6.0)
    likely = [5, BLOCK + 3, 2 * BLOCK + 250, vocab - 1]  # in four blocks, the last one ragged
    x[0, likely] = torch.tensor([2.0, 1.5, 1.0, 0.5])
    got = torch.tensor(sample(x.repeat(n, 1), [SamplerState.new(SamplingParams(temperature=1.0, seed=s))
                                                for s in range(n)])[0])
    freq = torch.bincount(got, minlength=vocab).float() / n
    torch.testing.assert_close(freq[likely], x[0].softmax(-1)[likely], atol=0.025, rtol=0)


def test_inverse_cdf_is_the_running_sum_search() -> None:
    rng = torch.Generator().manual_seed(14)
    for size in (1, 7, BLOCK, BLOCK + 1, 3 * BLOCK + 5):
        for _ in range(20):
            w = torch.rand(size, generator=rng) * (torch.rand(size, generator=rng) > 0.3)  # runs of zeros
            if not w.any():
                continue
            u = float(torch.rand(1, generator=rng, dtype=torch.float64)[0])
            running = torch.cumsum(w.double(), 0)
            want = int((running <= u * running[-1]).sum())  # the first index whose running sum exceeds
            assert _invert(w.numpy(), u) == want, (size, u)
            last = int(torch.nonzero(w)[-1])
            assert _invert(w.numpy(), math.nextafter(1.0, 0.0)) == last  # u just below 1: the last weight > 0
