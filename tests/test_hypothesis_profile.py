"""The suite's hypothesis profile (tests/conftest.py): derandomized with no example database, so a
property test draws the same examples on every run and on every machine."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st


def draws() -> list[list[int]]:
    """The examples one property test draws under the default profile, in order."""
    seen: list[list[int]] = []

    @settings(max_examples=30)
    @given(st.lists(st.integers(-1000, 1000), max_size=8))
    def record(xs: list[int]) -> None:
        seen.append(xs)

    record()
    return seen


def test_the_default_profile_is_the_fixed_one() -> None:
    assert settings.default.derandomize is True
    assert settings.default.database is None


def test_two_runs_draw_the_same_examples() -> None:
    first, second = draws(), draws()
    assert len(first) > 1 and len({tuple(x) for x in first}) > 1  # it did draw, and not one example over again
    assert first == second


def test_the_explore_profile_draws_anew() -> None:
    explore = settings.get_profile("explore")
    assert explore.derandomize is False
