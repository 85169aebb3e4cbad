"""`loadtests.soak.judge_rss`, the soak's RSS-growth judgement, on synthetic samples: it must fail a
replica that grows by the limit or more after minute 1 and pass one that does not. (The 1-minute soak
of tests/reliability cannot exercise it: a run of one minute has nothing after minute 1 to judge.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from loadtests.soak import RSS_GROWTH_LIMIT, judge_rss

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[2]
LIMIT_PCT = 100 * RSS_GROWTH_LIMIT


def minutes(*decode_mib: float, router_mib: float = 300.0) -> list[dict[str, float]]:
    """Per-minute samples: a decode replica as given, a router that stays flat."""
    return [{"decode:11": d, "router:10": router_mib} for d in decode_mib]


@pytest.mark.parametrize("decode", [
    (400.0, 430.0),  # +7.5% in minute 2
    (400.0, 405.0, 410.0, 421.0),  # a slow leak: +5.25% by minute 4
    (400.0, 420.0),  # exactly the limit fails
    (400.0, 300.0, 440.0),  # a dip first: the largest later sample counts
])
def test_growth_at_or_past_the_limit_fails(decode: tuple[float, ...]) -> None:
    verdict = judge_rss(minutes(*decode))
    assert not verdict.passed and verdict.grown == ("decode:11",), verdict
    assert verdict.max_growth_pct is not None and verdict.max_growth_pct >= LIMIT_PCT
    assert verdict.growth_pct["router:10"] == 0.0


@pytest.mark.parametrize("decode", [
    (400.0, 400.0, 400.0),
    (400.0, 419.9),  # +4.98%
    (400.0, 380.0, 410.0),
])
def test_growth_under_the_limit_passes(decode: tuple[float, ...]) -> None:
    verdict = judge_rss(minutes(*decode))
    assert verdict.passed and verdict.grown == (), verdict
    assert verdict.max_growth_pct is not None and verdict.max_growth_pct < LIMIT_PCT


def test_what_cannot_be_judged_is_said_so() -> None:
    one_minute = judge_rss(minutes(400.0))  # what the 1-minute soak test gets
    assert one_minute.passed and one_minute.max_growth_pct is None
    assert one_minute.growth_pct == {"decode:11": None, "router:10": None}
    assert judge_rss([]).max_growth_pct is None
    # a replica restarted in minute 2 (a new pid): the old one is not judged, nor is the new one
    restarted = judge_rss([{"decode:11": 400.0}, {"decode:12": 900.0}])
    assert restarted.passed and restarted.growth_pct == {"decode:11": None}


def test_the_limit_is_a_parameter() -> None:
    assert not judge_rss(minutes(400.0, 402.0), limit=0.004).passed
    assert judge_rss(minutes(400.0, 402.0), limit=0.01).passed


def test_importing_the_soak_patches_nothing_and_the_cli_still_loads() -> None:
    """The judgement is importable in a test process: locust (gevent's monkey-patching) only loads
    when the soak's CLI runs."""
    check = ("import sys, loadtests.soak; "
             "assert not {'locust', 'gevent', 'ssl'} & set(sys.modules), sorted({'locust', 'gevent', 'ssl'} "
             "& set(sys.modules))")
    subprocess.run([sys.executable, "-c", check], cwd=REPO, check=True, timeout=30)
    out = subprocess.run([sys.executable, "-m", "loadtests.soak", "--help"], cwd=REPO, capture_output=True,
                         text=True, timeout=30)
    assert out.returncode == 0 and "--minutes" in out.stdout, out.stderr[-2000:]
