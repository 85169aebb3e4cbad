"""`router.path_policy`, `engine.step_model` and `router.load_estimates`: the LOCAL/REMOTE decision,
the per-step token budget, and the estimates read from load reports (pure, no Ray)."""

from __future__ import annotations

import math
import random

import pytest

from engine.load_report import LoadReport
from engine.step_model import StepTimeModel, step_token_budget
from router.load_estimates import observed_step, pool_prefill_rate, prefill_rate, prefill_wait_s
from router.objectives import SLOClass
from router.path_policy import Path, PathInputs, PathParams, Reason, decide, estimate

pytestmark = pytest.mark.timeout(30)

# 20 ms a step + 0.1 ms a sequence + 1 µs a context token; 0.1 ms a prefilled token
STEP = StepTimeModel(base_s=0.020, per_seq_s=1e-4, per_context_token_s=1e-6, per_prefill_token_s=1e-4)
CHAT = SLOClass("chat", ttft_s=0.5, tpot_s=0.1, max_prompt_tokens=256)
PARAMS = PathParams(step=STEP, max_chunk_tokens=512, short_prompt_tokens=64, min_cached_fraction=0.5)


def test_step_time_is_the_linear_model() -> None:
    assert STEP.step_s(10, 1000, 200) == pytest.approx(0.020 + 0.001 + 0.001 + 0.02)
    with pytest.raises(ValueError, match="base_s"):
        StepTimeModel(base_s=0)
    with pytest.raises(ValueError, match="per_seq_s"):
        StepTimeModel(base_s=1, per_seq_s=-1)


def test_budget_keeps_the_step_inside_the_tightest_tpot_and_is_the_largest_that_does() -> None:
    rng = random.Random(0)
    for _ in range(200):
        batch, ctx = rng.randint(1, 64), rng.randint(0, 100_000)
        tpot, cap = rng.uniform(0.01, 0.3), rng.randint(1, 4096)
        b = step_token_budget(STEP, batch, ctx, tpot, cap, safety=0.9)
        assert 0 <= b <= cap
        if b > 0:
            assert STEP.step_s(batch, ctx, b) <= 0.9 * tpot + 1e-12
        if b < cap:  # one more token would break the objective (or none fits at all)
            assert STEP.step_s(batch, ctx, b + 1) > 0.9 * tpot - 1e-12


def test_budget_edges() -> None:
    assert step_token_budget(STEP, 0, 0, None, 512) == 512  # nothing running: the cap
    assert step_token_budget(STEP, 8, 1000, None, 512) == 512
    assert step_token_budget(STEP, 8, 1000, 0.02, 512) == 0  # the decode step alone breaks 0.9 * 20 ms
    # (0.9 * 0.1 - (0.02 + 0.0008 + 0.001)) / 1e-4 = 682 tokens, capped at 512 and uncapped
    assert step_token_budget(STEP, 8, 1000, 0.1, 512) == 512
    assert step_token_budget(STEP, 8, 1000, 0.1, 4096) == 682
    with pytest.raises(ValueError, match="safety"):
        step_token_budget(STEP, 1, 1, 0.1, 10, safety=0)


def _inputs(**kw: object) -> PathInputs:
    base: dict[str, object] = dict(prompt_tokens=30, cached_tokens=0, cls=CHAT, prefill_wait_s=0.0,
                                   prefill_rate_tps=2000.0, transfer_s=0.01, running=8, context_tokens=1000,
                                   running_tpot_s=0.1)
    base.update(kw)
    return PathInputs(**base)  # type: ignore[arg-type]


def test_a_short_prompt_is_prefilled_locally_in_one_step() -> None:
    d = decide(_inputs(), PARAMS)
    assert (d.path, d.reason) == (Path.LOCAL, Reason.SHORT)
    assert d.estimates.local_ttft_s == pytest.approx(STEP.step_s(8, 1000, 30))
    assert d.estimates.remote_ttft_s == pytest.approx(30 / 2000 + 0.01)


def test_a_long_prompt_goes_remote_while_the_pool_meets_its_objective() -> None:
    d = decide(_inputs(prompt_tokens=1400, cls=SLOClass("long", 6.0, 0.15)), PARAMS)
    assert (d.path, d.reason) == (Path.REMOTE, Reason.REMOTE_MEETS)


def test_a_mostly_cached_prompt_stays_local() -> None:
    d = decide(_inputs(prompt_tokens=1000, cached_tokens=800, cls=SLOClass("long", 6.0, 0.15)), PARAMS)
    assert (d.path, d.reason) == (Path.LOCAL, Reason.CACHED)
    assert d.estimates.uncached_tokens == 200


def test_a_prefill_pool_behind_its_objective_sends_the_prompt_local() -> None:
    # 1.2 s a chunk of someone's 1,400-token prompt ahead: the chat prompt's 0.5 s TTFT is lost remotely
    d = decide(_inputs(prompt_tokens=200, prefill_wait_s=1.2), PARAMS)
    assert (d.path, d.reason) == (Path.LOCAL, Reason.POOL_BEHIND)
    assert d.estimates.remote_ttft_s > CHAT.ttft_s >= d.estimates.local_ttft_s


def test_no_headroom_or_a_slow_local_prefill_goes_remote_even_when_short() -> None:
    d = decide(_inputs(running_tpot_s=0.02), PARAMS)
    assert (d.path, d.reason) == (Path.REMOTE, Reason.NO_HEADROOM) and math.isinf(d.estimates.local_ttft_s)
    # 40 k prompt tokens already queued on the replica: its local estimate misses 0.5 s
    d = decide(_inputs(local_queue_tokens=40_000), PARAMS)
    assert (d.path, d.reason) == (Path.REMOTE, Reason.LOCAL_TOO_SLOW)


def test_local_estimate_counts_budgeted_steps() -> None:
    e = estimate(_inputs(prompt_tokens=1100, cls=SLOClass("long", 6.0, 0.15), running=0, running_tpot_s=None,
                         context_tokens=0), PARAMS)
    assert e.step_budget_tokens == 512
    assert e.local_ttft_s == pytest.approx(3 * STEP.step_s(0, 0, 512))  # ceil(1100 / 512) steps


@pytest.mark.parametrize("seed", range(5))
def test_local_is_chosen_only_when_its_estimate_meets_the_objective(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(300):
        n = rng.randint(1, 4000)
        x = _inputs(prompt_tokens=n, cached_tokens=rng.randint(0, n), prefill_wait_s=rng.uniform(0, 5),
                    running=rng.randint(0, 64), context_tokens=rng.randint(0, 50_000),
                    running_tpot_s=rng.choice([None, 0.05, 0.1, 0.3]), local_queue_tokens=rng.randint(0, 3000),
                    cls=SLOClass("c", rng.uniform(0.1, 5), 0.1))
        d = decide(x, PARAMS)
        if d.path is Path.LOCAL:
            assert d.estimates.local_ttft_s <= x.cls.ttft_s and d.estimates.step_budget_tokens > 0
        elif d.reason is Reason.REMOTE_MEETS:
            assert d.estimates.remote_ttft_s <= x.cls.ttft_s


def test_bad_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="cached_tokens"):
        _inputs(cached_tokens=31)
    with pytest.raises(ValueError, match="prefill_rate_tps"):
        _inputs(prefill_rate_tps=0)


def _report(rid: str, **kw: object) -> LoadReport:
    base: dict[str, object] = dict(replica_id=rid, role="prefill", num_waiting=0, num_running=0,
                                   outstanding_tokens=0, kv_blocks_free=1, kv_blocks_total=1)
    base.update(kw)
    return LoadReport(**base)  # type: ignore[arg-type]


def test_prefill_rate_and_wait_from_reports() -> None:
    a0 = _report("a", prefill_tokens=1000, prefill_seconds=1.0)
    a1 = _report("a", prefill_tokens=3000, prefill_seconds=2.0)
    b0 = _report("b", prefill_tokens=0, prefill_seconds=0.0)
    b1 = _report("b", prefill_tokens=1000, prefill_seconds=1.0)
    assert prefill_rate(a0, a1) == 2000.0
    assert prefill_rate(a1, a1) is None and prefill_rate(a1, a0) is None  # idle window, restarted replica
    assert pool_prefill_rate({"a": a0, "b": b0}, {"a": a1, "b": b1, "c": _report("c")}) == pytest.approx(1500.0)
    assert pool_prefill_rate({}, {"a": a1}) is None
    reports = [_report("a", outstanding_tokens=3000), _report("b", outstanding_tokens=1000),
               _report("c", outstanding_tokens=0, ready=False)]
    assert prefill_wait_s(reports, 2000.0) == 0.5  # the least loaded ready one
    assert math.isinf(prefill_wait_s([], 1.0))


def test_observed_decode_step() -> None:
    r0 = _report("d", role="decode", steps=10, step_seconds=0.5, step_sequences=40)
    r1 = _report("d", role="decode", steps=30, step_seconds=1.5, step_sequences=200)
    s = observed_step(r0, r1)
    assert s is not None and s.step_s == pytest.approx(0.05) and s.batch == 8.0
    assert observed_step(r1, r1) is None
