"""`engine.prefill_planner`: the split of a prefill forward's token budget, pure (no model)."""

from __future__ import annotations

import random

import pytest

from engine.prefill_planner import grant_order, grant_tokens, wants_more

pytestmark = pytest.mark.timeout(30)


def test_short_prompts_pass_a_long_one_between_its_chunks() -> None:
    # a 2,000-token prompt at the head, three chat prompts behind it, budget 2,048, cap 512
    assert grant_tokens([2000, 100, 120, 90], 2048, 512) == [512, 100, 120, 90]


def test_without_a_cap_the_long_prompt_takes_the_budget() -> None:
    assert grant_tokens([2000, 100, 120], 2048, 2048) == [2000, 48, 0]


def test_oldest_always_advances_however_many_short_ones_wait() -> None:
    grants = grant_tokens([1000] + [64] * 100, 2048, 512)
    assert grants[0] == 512 and sum(grants) == 2048


def test_after_the_oldest_the_shortest_remaining_go_first() -> None:
    assert grant_tokens([300, 900, 50, 400], 600, 512) == [300, 0, 50, 250]


def test_empty_zero_budget_and_finished_jobs() -> None:
    assert grant_tokens([], 2048, 512) == []
    assert grant_tokens([10, 10], 0, 512) == [0, 0]
    assert grant_tokens([0, 5], 100, 512) == [0, 5]


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError):
        grant_tokens([1], -1, 512)
    with pytest.raises(ValueError):
        grant_tokens([1], 10, 0)
    with pytest.raises(ValueError):
        grant_tokens([-1], 10, 5)


def test_wants_more_until_the_admitted_can_fill_the_budget() -> None:
    assert wants_more([], 2048, 512)
    assert wants_more([2000], 2048, 512)  # it can use only 512 of 2,048 this step
    assert not wants_more([2000, 2000, 2000, 2000], 2048, 512)
    assert not wants_more([2048], 2048, 2048)


@pytest.mark.parametrize("seed", range(20))
def test_invariants_on_random_queues(seed: int) -> None:
    rng = random.Random(seed)
    remaining = [rng.choice([0, rng.randint(1, 64), rng.randint(1, 4096)]) for _ in range(rng.randint(1, 30))]
    budget, cap = rng.randint(1, 4096), rng.randint(1, 2048)
    grants = grant_tokens(remaining, budget, cap)
    assert len(grants) == len(remaining) and sum(grants) <= budget
    assert all(0 <= g <= min(r, cap) for g, r in zip(grants, remaining, strict=True))
    if remaining[0] > 0:
        assert grants[0] == min(remaining[0], cap, budget)
    # budget left over only when every job got all it may take this step
    if sum(grants) < budget:
        assert all(g == min(r, cap) for g, r in zip(grants, remaining, strict=True))


# ---- deadlines: earliest-deadline-first ----

def test_deadlines_order_the_grants_earliest_first_then_shortest() -> None:
    # a long prompt (deadline 6 s) at the head, chat prompts due at 0.5 s behind it: they go first
    assert grant_tokens([2000, 100, 120, 90], 512, 512, deadlines=[6.0, 0.5, 0.5, 0.6]) == [202, 100, 120, 90]
    assert grant_order([2000, 100, 120, 90], [6.0, 0.5, 0.5, 0.6]) == [1, 2, 3, 0]
    assert grant_order([5, 5], [1.0, 1.0]) == [0, 1]  # full ties: FIFO
    assert grant_order([300, 900, 50, 400]) == [0, 2, 3, 1]  # no deadlines: as before
    with pytest.raises(ValueError, match="one deadline per job"):
        grant_tokens([1, 2], 10, 5, deadlines=[1.0])


def _run(arrivals: list[tuple[float, int, float]], budget: int, cap: int, step_s: float,
         deadlines: bool, horizon_s: float) -> dict[int, float]:
    """A prefill replica stepping every ``step_s`` over jobs (arrival, tokens, deadline): finish times."""
    remaining: dict[int, int] = {}
    done: dict[int, float] = {}
    now, nxt = 0.0, 0
    while now < horizon_s and (nxt < len(arrivals) or remaining):
        while nxt < len(arrivals) and arrivals[nxt][0] <= now:
            remaining[nxt] = arrivals[nxt][1]
            nxt += 1
        ids = sorted(remaining)  # FIFO
        grants = grant_tokens([remaining[i] for i in ids], budget, cap,
                              [arrivals[i][2] for i in ids] if deadlines else None)
        now += step_s
        for i, g in zip(ids, grants, strict=True):
            remaining[i] -= g
            if remaining[i] == 0:
                del remaining[i]
                done[i] = now
    return done


def test_earliest_deadline_meets_deadlines_that_oldest_first_misses() -> None:
    # three 4,000-token prompts (objective 6 s) at t=0, then a 30-token chat prompt (0.5 s) every 0.25 s;
    # 0.1 s a forward of <= 512 tokens, no chunk cap: the oldest-first order spends whole forwards on
    # the long prompts while the chat prompts behind them wait
    jobs = [(0.0, 4000, 6.0)] * 3 + [(0.25 * k, 30, 0.25 * k + 0.5) for k in range(40)]
    for edf in (True, False):
        done = _run(jobs, 512, 512, 0.1, edf, 60.0)
        missed = [i for i, (_, _, d) in enumerate(jobs) if done[i] > d + 1e-9]
        assert (missed == []) == edf, (edf, missed)


@pytest.mark.parametrize("cap", [64, 256, 512])
def test_a_long_prompt_is_not_starved_by_an_overload_of_short_ones(cap: int) -> None:
    """Chat prompts arrive faster than the replica serves them (overload, for ever): by deadlines the
    long prompt still finishes within a bound that does not grow with the stream. The bound: every
    chat prompt due before it (those that arrived before its deadline less their objective) served at
    the full budget, then its own chunks."""
    step, budget, t_short, t_long, long = 0.1, 512, 0.5, 6.0, 3000
    jobs = [(0.0, long, t_long)] + [(0.01 * k, 64, 0.01 * k + t_short) for k in range(6000)]  # 6,400 tok/s
    done = _run(jobs, budget, cap, step, True, 60.0)
    ahead = sum(n for a, n, d in jobs[1:] if d < t_long)
    bound = (-(-ahead // budget) + -(-long // cap) + 1) * step
    assert 0 in done and done[0] <= bound
    assert len(done) < len(jobs)  # it was an overload: chat prompts were still queued at the end
