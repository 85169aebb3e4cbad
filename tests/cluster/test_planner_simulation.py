"""`cluster.planner.simulator` and `.search`: simulated requests timed exactly as the fitted models
say, the code's path decision and prefill order at work, and the search over splits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cluster.cli import main
from cluster.planner.profile import fit
from cluster.planner.search import Candidate, plan
from cluster.planner.simulator import Shape, simulate
from cluster.planner.workload import Arrival, arrivals
from tests.support.planner_profiles import known_profile, spec

pytestmark = pytest.mark.timeout(120)
FP = fit(known_profile())
OBJ = spec().built_objectives()


def _decode_s(context: int, steps: int) -> float:
    return sum(FP.step.step_s(1, context + k) for k in range(steps))


def test_a_lone_remote_request_takes_exactly_its_chunks_transfer_and_steps() -> None:
    r = simulate(FP, Shape(1, 1, chunk_tokens=512, conditional=False), [Arrival(0.0, 600, 8)], OBJ, 0.0)
    ttft = FP.prefill.seconds(512) + FP.prefill.seconds(88)  # two chunks of the 600-token prompt
    steps = _decode_s(601, 7)  # prompt + token 0, then tokens 1..7 one step each
    assert r.ttft_p50_s == pytest.approx(ttft)
    assert r.tpot_p50_s == pytest.approx((FP.transfer_s(600) + steps) / 7)
    assert r.by_path == {"remote": 1} and r.attained == 1


def test_a_lone_colocated_request_is_prefilled_in_chunks_between_steps() -> None:
    r = simulate(FP, Shape(0, 1, chunk_tokens=512), [Arrival(0.0, 600, 8)], OBJ, 0.0)
    assert r.ttft_p50_s == pytest.approx(FP.step.step_s(0, 0, 512) + FP.step.step_s(0, 0, 88))
    assert r.tpot_p50_s == pytest.approx(_decode_s(600, 7) / 7)
    assert r.by_path == {"local": 1}


def test_local_chunks_keep_running_streams_inside_their_tpot_unless_told_to_run_fixed_chunks() -> None:
    # a chat stream of 3 tokens decoding when a 1,000-token prompt arrives on the same replica
    reqs = [Arrival(0.0, 20, 3), Arrival(0.03, 1000, 2)]
    budgeted = simulate(FP, Shape(0, 1, chunk_tokens=1024), reqs, OBJ, 0.0)
    fixed = simulate(FP, Shape(0, 1, chunk_tokens=1024, tpot_budget=False), reqs, OBJ, 0.0)
    # a whole 1,000-token chunk beside its last step (> 0.2 s) takes the chat stream's mean past 0.1 s;
    # under the budget each step stays within 0.9 x 0.1 s
    assert FP.step.step_s(1, 22, 1000) > 0.2
    assert budgeted.by_class == {"chat": (1, 1), "long": (1, 1)}
    assert fixed.by_class == {"chat": (0, 1), "long": (1, 1)}


def test_the_path_decision_sends_short_prompts_local_and_long_ones_remote_when_the_pool_keeps_up() -> None:
    s = spec(requests=40)
    reqs = arrivals(s, 0.5)  # far below capacity: the pool's wait is nil
    r = simulate(FP, Shape(1, 1), reqs, OBJ, 0.0)
    assert r.by_path == {"local": sum(a.prompt_tokens <= 64 for a in reqs),
                         "remote": sum(a.prompt_tokens > 64 for a in reqs)}
    assert r.attainment == 1.0


def test_overload_loses_attainment_and_runs_are_deterministic() -> None:
    s = spec(requests=200)  # a replica pair serves some 50 requests/s of this mix
    low = simulate(FP, Shape(1, 1), arrivals(s, 2.0), OBJ)
    high = simulate(FP, Shape(1, 1), arrivals(s, 300.0), OBJ)
    assert low.attainment == 1.0 and high.attainment < 0.5
    assert simulate(FP, Shape(1, 1), arrivals(s, 300.0), OBJ) == high


def test_the_search_never_plans_worse_than_colocated_and_scales_a_slice_back() -> None:
    s = spec(requests=40)
    plans = plan(FP, s, [1.0, 6.0], gpus=3, chunks=[128, 512])
    for p in plans:
        assert Candidate.key(p.best) >= Candidate.key(p.colocated)
        assert p.always_remote is not None and not p.always_remote.shape.conditional
        assert sum(p.split(p.best)) == 3 and p.scale == 1.0
    sliced = plan(FP, s, [2.0], gpus=6, chunks=[256], slice_replicas=3)[0]
    assert sliced.scale == 2.0 and sum(sliced.split(sliced.best)) == 6
    assert sliced.split(sliced.best)[0] % 2 == 0  # splits come in steps of the scale
    assert sliced.goodput(sliced.best) == pytest.approx(2 * sliced.best.result.goodput)


def test_pdserve_plan_prints_writes_and_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    known_profile().save(tmp_path / "p.json")
    (tmp_path / "w.json").write_text(json.dumps(spec(requests=30).model_dump(mode="json", exclude_none=True)))
    rc = main(["plan", "--profile", str(tmp_path / "p.json"), "--workload", str(tmp_path / "w.json"), "--gpus", "2",
               "--rates", "1,3", "--chunks", "256", "--out", str(tmp_path / "plan.json"),
               "--plot", str(tmp_path / "plan.png")])
    out = capsys.readouterr().out
    assert rc == 0 and "known models [measured]" in out and "highest planned rate" in out
    data = json.loads((tmp_path / "plan.json").read_text())
    assert [r["rate"] for r in data["rates"]] == [1.0, 3.0] and data["profile"]["source"] == "measured"
    assert (tmp_path / "plan.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (tmp_path / "bad.yaml").write_text("objectives: {classes: []}\nmix: []\n")
    assert main(["plan", "--profile", str(tmp_path / "p.json"), "--workload", str(tmp_path / "bad.yaml"),
                 "--gpus", "2", "--rates", "1"]) == 2
    assert "bad.yaml: invalid workload" in capsys.readouterr().err
