"""The batched sampler against its references: transformers' logits processors, OpenAI's penalty
formula, and a brute-force per-row sampler with the same seeding (no model)."""

from __future__ import annotations

import math
import random

import pytest
import torch
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from engine import sampling
from engine.sampling import SamplerState, SamplingParams, bias_and_min_tokens, penalties, sample, truncate

pytestmark = pytest.mark.timeout(60)
V = 50
NEG = float("-inf")


def logits(b: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(b, V, generator=torch.Generator().manual_seed(seed)) * 3  # [B, V]


def ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(V) for _ in range(n)]


@pytest.mark.parametrize("penalty", [0.5, 1.3, 2.0])
def test_repetition_penalty_matches_transformers(penalty: float) -> None:
    rng = random.Random(1)
    x = logits(4)
    prompts, outputs = [ids(rng, 6) for _ in range(4)], [ids(rng, 5) for _ in range(4)]
    pairs = list(zip(prompts, outputs, strict=True))
    states = [SamplerState.new(SamplingParams(repetition_penalty=penalty), p, o) for p, o in pairs]
    ref = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([p + o for p, o in pairs]), x.clone())
    torch.testing.assert_close(penalties(x, states), ref)


def test_frequency_and_presence_follow_openai_over_the_output_only() -> None:
    rng = random.Random(2)
    x = logits(3)
    cases = [(0.7, -0.4), (-1.5, 2.0), (0.0, 0.0)]
    states = [SamplerState.new(SamplingParams(frequency_penalty=f, presence_penalty=p), ids(rng, 8), ids(rng, 9))
              for f, p in cases]
    want = x.clone()
    for row, (st, (f, p)) in enumerate(zip(states, cases, strict=True)):
        for j in range(V):  # mu[j] - c[j] * alpha_frequency - float(c[j] > 0) * alpha_presence
            c = st.output_ids.count(j)
            want[row, j] -= c * f + (1.0 if c > 0 else 0.0) * p
    torch.testing.assert_close(penalties(x, states), want)


def test_penalty_books_follow_recorded_tokens() -> None:
    st = SamplerState.new(SamplingParams(repetition_penalty=1.5, frequency_penalty=1.0), [3, 4], [5])
    x = torch.zeros(1, V) + 1.0
    penalties(x, [st])  # builds the books
    st.record(7)
    st.record(7)
    out = penalties(x, [st])[0]
    assert out[7].item() == pytest.approx(1 / 1.5 - 2) and out[5].item() == pytest.approx(1 / 1.5 - 1)
    assert out[3].item() == pytest.approx(1 / 1.5) and out[9].item() == 1.0


@pytest.mark.parametrize(("name", "values", "warper"), [
    ("top_k", [1, 5, 17], TopKLogitsWarper),
    ("top_p", [0.1, 0.5, 0.93], TopPLogitsWarper),
    ("min_p", [0.01, 0.2, 0.8], MinPLogitsWarper),
])
def test_truncation_matches_transformers_row_by_row(name: str, values: list[float], warper: type) -> None:
    x = logits(len(values), seed=3)
    got = truncate(x, [SamplingParams(temperature=1.0, **{name: v}) for v in values])
    for row, v in enumerate(values):
        ref = warper(v)(None, x[row : row + 1].clone())[0]
        assert torch.equal(torch.isinf(got[row]), torch.isinf(ref)), (name, v)
        torch.testing.assert_close(got[row][~torch.isinf(ref)], ref[~torch.isinf(ref)])


def test_top_k_keeps_ties_as_transformers_does() -> None:
    x = torch.tensor([[1.0, 3.0, 2.0, 2.0, 0.0] + [-5.0] * (V - 5)])
    got = truncate(x, [SamplingParams(temperature=1.0, top_k=2)])
    ref = TopKLogitsWarper(2)(None, x.clone())
    assert torch.equal(torch.isinf(got), torch.isinf(ref)) and int((~torch.isinf(got)).sum()) == 3


def test_min_tokens_masks_stop_ids_until_reached_as_transformers_does() -> None:
    x = logits(1, seed=4)
    params = SamplingParams(min_tokens=3, stop_token_ids=(7,))
    prompt = [1, 2, 3]
    for done in range(5):
        st = SamplerState.new(params, prompt, list(range(10, 10 + done)), eos_ids=(2,))
        ref = MinNewTokensLengthLogitsProcessor(len(prompt), 3, [7, 2])(
            torch.tensor([prompt + st.output_ids]), x.clone())
        torch.testing.assert_close(bias_and_min_tokens(x, [st]), ref)
    ignoring = SamplerState.new(SamplingParams(min_tokens=3, ignore_eos=True), prompt, eos_ids=(2,))
    assert not torch.isinf(bias_and_min_tokens(x, [ignoring])).any()


def test_logit_bias_is_added() -> None:
    x = logits(2, seed=5)
    biased = SamplingParams(logit_bias=((3, 100.0), (4, -100.0)))
    states = [SamplerState.new(biased), SamplerState.new(SamplingParams())]
    got = bias_and_min_tokens(x, states)
    want = x.clone()
    want[0, 3] += 100
    want[0, 4] -= 100
    torch.testing.assert_close(got, want)
    assert sample(x[:1], [SamplerState.new(SamplingParams(logit_bias=((9, 100.0),)))])[0] == [9]


def reference_row(raw: torch.Tensor, st: SamplerState) -> int:
    """One row, the pipeline written out token by token (the module docstring's order)."""
    p = st.params
    x = raw.clone().tolist()
    for tid, b in p.logit_bias:
        x[tid] += b
    if st.step < p.min_tokens:
        for tid in st.min_tokens_mask_ids:
            x[tid] = NEG
    seen = set(st.prompt_ids) | set(st.output_ids)
    for j in range(V):
        if j in seen and p.repetition_penalty != 1.0:
            x[j] = x[j] * p.repetition_penalty if x[j] < 0 else x[j] / p.repetition_penalty
        c = st.output_ids.count(j)
        x[j] -= c * p.frequency_penalty + (p.presence_penalty if c else 0.0)
    if p.greedy:
        return max(range(V), key=lambda j: x[j])
    x = [v / p.temperature for v in x]
    top = max(x)
    if p.min_p > 0:  # p_j >= min_p * p_max  <=>  x_j >= x_max + log(min_p)
        x = [v if v >= top + math.log(p.min_p) else NEG for v in x]
    if 0 < p.top_k < V:
        kth = sorted(x, reverse=True)[p.top_k - 1]
        x = [v if v >= kth else NEG for v in x]
    if p.top_p < 1:
        probs = torch.tensor(x).softmax(-1).tolist()
        mass, keep = 0.0, set()
        for j in sorted(range(V), key=lambda j: -x[j]):
            if mass >= p.top_p:
                break
            keep.add(j)
            mass += probs[j]
        x = [v if j in keep else NEG for j, v in enumerate(x)]
    gen = st.generator(torch.device("cpu"))
    assert gen is not None
    probs = torch.tensor(x).softmax(-1)
    cand = [j for j in range(V) if probs[j] > 0]  # the draw is among the candidates, in token-id order
    return cand[int(torch.multinomial(probs[cand], 1, generator=gen)[0])]


PARAMS = [
    SamplingParams(),
    SamplingParams(temperature=0.8, seed=1),
    SamplingParams(temperature=1.2, seed=2, top_k=7, top_p=0.9),
    SamplingParams(temperature=0.7, seed=3, min_p=0.1, repetition_penalty=1.4),
    SamplingParams(repetition_penalty=1.8, frequency_penalty=0.5, presence_penalty=0.3),
    SamplingParams(temperature=1.0, seed=4, frequency_penalty=-0.5, logit_bias=((11, 5.0),), min_tokens=4,
                   stop_token_ids=(0, 1)),
    SamplingParams(temperature=0.5, seed=5, top_p=0.3, min_p=0.05),
]


def test_batched_sampler_equals_brute_force_rows_and_ignores_its_batch() -> None:
    rng = random.Random(6)
    for step in range(6):
        x = logits(len(PARAMS), seed=10 + step)
        prompts = [ids(rng, 5) for _ in PARAMS]
        outs = [ids(rng, step) for _ in PARAMS]
        batch = [SamplerState.new(p, pr, o, eos_ids=(2,)) for p, pr, o in zip(PARAMS, prompts, outs, strict=True)]
        want = [reference_row(x[i], SamplerState.new(p, pr, o, eos_ids=(2,)))
                for i, (p, pr, o) in enumerate(zip(PARAMS, prompts, outs, strict=True))]
        got, lps, _ = sample(x, batch)
        assert got == want, step
        for i, (p, pr, o) in enumerate(zip(PARAMS, prompts, outs, strict=True)):
            alone = sample(x[i : i + 1], [SamplerState.new(p, pr, o, eos_ids=(2,))])[0]
            assert alone == [got[i]] or (p.seed is None and not p.greedy)
        torch.testing.assert_close(torch.tensor(lps), x.log_softmax(-1).gather(1, torch.tensor(got)[:, None])[:, 0])
        assert all(st.output_ids[-1] == t for st, t in zip(batch, got, strict=True))


def test_unseeded_draws_follow_the_distribution() -> None:
    x = torch.tensor([[2.0, 1.0, 0.0, -1.0] + [-30.0] * (V - 4)]).repeat(20000, 1)
    states = [SamplerState.new(SamplingParams(temperature=1.0)) for _ in range(len(x))]
    got = torch.tensor(sample(x, states)[0])
    freq = torch.bincount(got, minlength=V)[:4].float() / len(got)
    torch.testing.assert_close(freq, x[0, :4].softmax(-1) / x[0].softmax(-1)[:4].sum(), atol=0.015, rtol=0)


def test_plain_requests_skip_the_optional_stages(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*_: object) -> None:
        raise AssertionError("stage ran for a plain request")

    for name in ("bias_and_min_tokens", "penalties"):
        monkeypatch.setattr(sampling, name, boom)
    sample(logits(3), [SamplerState.new(SamplingParams(temperature=t, seed=1)) for t in (0.0, 0.7, 1.0)])


@pytest.mark.parametrize("bad", [
    {"min_p": 1.5}, {"presence_penalty": 3}, {"frequency_penalty": -2.5}, {"repetition_penalty": 0},
    {"logit_bias": ((1, 101.0),)}, {"logit_bias": ((-1, 1.0),)}, {"min_tokens": 20, "max_tokens": 10},
])
def test_params_are_validated(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("heads", [(4,), (4, 16), (256,)])
def test_top_p_head_and_full_sort_agree_with_transformers(heads: tuple[int, ...],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sampling, "TOP_P_HEADS", heads)  # 4: most nuclei reach past the head; 256: V or more
    x = logits(4, seed=7) * torch.tensor([[0.2], [1.0], [2.0], [1.0]])
    values = [0.95, 0.5, 0.9, 1.0]
    got = truncate(x, [SamplingParams(temperature=1.0, top_p=v) for v in values])
    for row, v in enumerate(values):
        ref = TopPLogitsWarper(v)(None, x[row : row + 1].clone())[0] if v < 1 else x[row]
        assert torch.equal(torch.isinf(got[row]), torch.isinf(ref)), (heads, v)


def test_top_logprobs_are_the_unmodified_distributions_best() -> None:
    x = logits(3, seed=8)
    params = [SamplingParams(logprobs=True, top_logprobs=5, temperature=0.5, seed=1, repetition_penalty=2.0,
                             logit_bias=((0, -100.0),)),
              SamplingParams(logprobs=True),
              SamplingParams(logprobs=True, top_logprobs=20)]
    out = sample(x, [SamplerState.new(p, [0, 1, 2]) for p in params])
    ref = x.log_softmax(-1)
    for row, k in enumerate((5, 0, 20)):
        vals, idx = ref[row].topk(k) if k else (torch.empty(0), torch.empty(0, dtype=torch.long))
        assert [t for t, _ in out.top[row]] == idx.tolist()
        torch.testing.assert_close(torch.tensor([v for _, v in out.top[row]]), vals)


def test_ids_past_the_logits_are_left_alone() -> None:
    x = logits(1, seed=9)
    st = SamplerState.new(SamplingParams(logit_bias=((V + 3, 50.0),), min_tokens=2, stop_token_ids=(V + 1,)))
    torch.testing.assert_close(bias_and_min_tokens(x, [st]), x)
