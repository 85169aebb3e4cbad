"""`prefill_worker.planner`: the split of a prefill forward's token budget, pure (no model)."""

from __future__ import annotations

import random

import pytest

from prefill_worker.planner import grant_tokens, wants_more

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
