"""`engine.step_fit.StepFit` on synthetic steps: no fit before ``min_samples``; the least-squares
solution (numpy's `lstsq` on the same data is the oracle) when every term varies; a term the window
cannot identify keeps the prior's coefficient; a term the data would make negative is 0 and the rest
still fit; the window forgets old steps."""

from __future__ import annotations

import random

import numpy as np
import pytest

from engine.step_fit import MIN_BASE_S, StepFit
from engine.step_model import PRIOR, StepTimeModel

TRUE = StepTimeModel(base_s=0.012, per_seq_s=0.0007, per_context_token_s=2e-6, per_prefill_token_s=1.5e-4)


def steps(model: StepTimeModel, n: int, seed: int, prefill: bool = True, noise: float = 0.0
          ) -> list[tuple[int, int, int, float]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        b = rng.randint(1, 48)
        ctx = b * rng.randint(20, 900)
        p = rng.choice([0, 0, rng.randint(1, 512)]) if prefill else 0
        out.append((b, ctx, p, model.step_s(b, ctx, p) * (1 + rng.uniform(-noise, noise))))
    return out


def fed(data: list[tuple[int, int, int, float]], **kw: int) -> StepFit:
    fit = StepFit(PRIOR, **kw)
    for step in data:
        fit.add(*step)
    return fit


def coefs(m: StepTimeModel) -> list[float]:
    return [m.base_s, m.per_seq_s, m.per_context_token_s, m.per_prefill_token_s]


def test_no_fit_before_min_samples() -> None:
    data = steps(TRUE, 32, 1)
    assert fed(data[:31], min_samples=32).model() is None
    assert fed(data, min_samples=32).model() is not None


def test_exact_steps_give_the_true_model() -> None:
    got = fed(steps(TRUE, 200, 2)).model()
    assert got is not None and coefs(got) == pytest.approx(coefs(TRUE), rel=1e-6)


def test_noisy_steps_give_the_least_squares_solution() -> None:
    data = steps(TRUE, 300, 3, noise=0.2)
    got = fed(data).model()
    x = np.array([[1, b, c, p] for b, c, p, _ in data], dtype=np.float64)
    want, *_ = np.linalg.lstsq(x, np.array([s for *_, s in data]), rcond=None)
    assert got is not None and min(want) > 0  # the oracle's solution is feasible, so it is the fit
    assert coefs(got) == pytest.approx(list(want), rel=1e-9)
    assert coefs(got) == pytest.approx(coefs(TRUE), rel=0.25)


def test_a_term_the_window_cannot_identify_keeps_the_prior() -> None:
    got = fed(steps(TRUE, 100, 4, prefill=False)).model()  # no step prefilled anything
    assert got is not None and got.per_prefill_token_s == PRIOR.per_prefill_token_s
    assert coefs(got)[:3] == pytest.approx(coefs(TRUE)[:3], rel=1e-6)


def test_a_term_the_data_makes_negative_is_zero() -> None:
    """Steps that get faster with context (impossible in the model): that coefficient is 0, and the
    others are the least squares of the data without it."""
    rng = random.Random(5)
    data = []
    for _ in range(80):
        b, ctx, p = rng.randint(1, 32), rng.randint(100, 5000), rng.randint(0, 256)
        data.append((b, ctx, p, 0.01 + 0.001 * b - 1e-6 * ctx + 1e-4 * p))
    got = fed(data).model()
    assert got is not None and got.per_context_token_s == 0.0
    x = np.array([[1, b, p] for b, _, p, _ in data], dtype=np.float64)
    want, *_ = np.linalg.lstsq(x, np.array([s for *_, s in data]), rcond=None)
    assert [got.base_s, got.per_seq_s, got.per_prefill_token_s] == pytest.approx(list(want), rel=1e-9)


def test_the_fixed_part_stays_positive() -> None:
    data = [(b, 0, 0, 0.001 * b) for b in range(1, 40)]  # all per-sequence, no fixed part
    got = fed(data).model()
    assert got is not None and got.base_s >= MIN_BASE_S and got.per_seq_s == pytest.approx(0.001, rel=1e-3)


def test_the_window_forgets_old_steps() -> None:
    slow = StepTimeModel(base_s=0.1, per_seq_s=0.01, per_context_token_s=1e-5, per_prefill_token_s=1e-3)
    fit = fed(steps(slow, 64, 6), window=64)
    for step in steps(TRUE, 64, 7):
        fit.add(*step)
    got = fit.model()
    assert len(fit) == 64 and got is not None and coefs(got) == pytest.approx(coefs(TRUE), rel=1e-6)


def test_bad_steps_are_refused() -> None:
    fit = StepFit(PRIOR)
    with pytest.raises(ValueError, match="seconds > 0"):
        fit.add(1, 10, 0, 0.0)
    with pytest.raises(ValueError, match="window >= min_samples"):
        StepFit(PRIOR, window=8, min_samples=16)
