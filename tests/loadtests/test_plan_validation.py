"""`loadtests.plan_validation`: a goodput sweep's own arrivals replayed through the planner's simulation
with the mode's shape, side by side with the measured attainment."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.config import ClusterConfig
from loadtests.plan_validation import arrivals, objectives, shape, validate
from tests.support.planner_profiles import known_profile

pytestmark = pytest.mark.timeout(60)
REPO = Path(__file__).resolve().parents[2]
SLO = {"ttft_ms": {"chat": 2000.0, "long": 30000.0}, "tpot_ms": 500.0}


def _doc(measured: list[float]) -> dict[str, object]:
    spread = [["chat", 0.0, 1, 1, True], ["long", 30.0, 1, 1, True], ["chat", 60.0, 1, 1, True]]
    return {"created": "then", "results": {"slo": SLO, "modes": {"disaggregated": {"rates": [
        {"rate_rps": 0.05, "attainment": m, "samples": spread} for m in measured]}}}}


def test_the_sweeps_kinds_slos_and_shape_become_the_planners() -> None:
    obj = objectives(SLO)
    chat, long = obj.classify(130), obj.classify(131)
    assert chat is not None and (chat.name, chat.ttft_s, chat.tpot_s) == ("chat", 2.0, 0.5)
    assert long is not None and (long.name, long.ttft_s) == ("long", 30.0)
    got = arrivals([["long", 2.5, 0, 0, True], ["chat", 1.0, 0, 0, True]])
    assert [(a.t, a.prompt_tokens, a.output_tokens) for a in got] == [(1.0, 130, 128), (2.5, 2030, 64)]
    cfg = ClusterConfig.from_yaml(REPO / "deploy/bench-disaggregated.yaml")
    sh = shape(cfg)
    assert (sh.prefill_replicas, sh.decode_replicas, sh.conditional) == (cfg.prefill.num_replicas,
                                                                        cfg.decode.num_replicas, False)
    colocated = shape(ClusterConfig.from_yaml(REPO / "deploy/bench-colocated.yaml"))
    assert colocated.prefill_replicas == 0 and not colocated.tpot_budget


def test_predicted_beside_measured_and_the_tolerance_judged() -> None:
    cfg = ClusterConfig.from_yaml(REPO / "deploy/bench-disaggregated.yaml")
    # three lone requests a long way apart, objectives a fast replica meets: predicted 100%
    ok = validate(_doc([1.0, 0.95]), "disaggregated", known_profile(), cfg)
    assert [r["predicted"] for r in ok["rates"]] == [1.0, 1.0]
    assert [r["diff_points"] for r in ok["rates"]] == [0.0, 5.0] and ok["within_tolerance"]
    off = validate(_doc([1.0, 0.5]), "disaggregated", known_profile(), cfg)
    assert not off["within_tolerance"] and off["rates"][1]["diff_points"] == 50.0
    assert ok["profile"]["source"] == "measured"
