"""The sampler's parameters and logit stages against their references: transformers' logits
processors, OpenAI's penalty formula (no model). The truncation and the draw: test_sampling_draw."""

from __future__ import annotations

import random

import pytest
import torch
from transformers.generation.logits_process import MinNewTokensLengthLogitsProcessor, RepetitionPenaltyLogitsProcessor

from engine.sampling import sampler as sampling
from engine.sampling.sampler import SamplerState, SamplingParams, bias_and_min_tokens, penalties, sample

pytestmark = pytest.mark.timeout(60)
V = 50


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


def test_penalties_touch_only_their_rows_and_ids_inside_the_logits() -> None:
    rng = random.Random(3)
    x = logits(3, seed=11)
    prompt = [*ids(rng, 6), V + 5]  # a tokenizer id past the model's head: no logit to move
    states = [SamplerState.new(SamplingParams(repetition_penalty=1.7, presence_penalty=0.4), prompt, [1, 1, 2]),
              SamplerState.new(SamplingParams(), prompt, [1]),
              SamplerState.new(SamplingParams(frequency_penalty=1.0), prompt, [])]  # nothing in its book yet
    got = penalties(x, states)
    ref = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([[*prompt[:-1], 1, 1, 2]]), x[:1].clone())
    ref[0, 1:3] -= 0.4
    torch.testing.assert_close(got[0], ref[0])
    assert torch.equal(got[1:], x[1:])


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
