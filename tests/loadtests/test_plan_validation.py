"""`loadtests.plan_validation`: a goodput sweep's own arrivals replayed through the planner's simulation
with the server's shape, side by side with the measured attainment."""

from __future__ import annotations

import pytest
import yaml

from cluster.config import ClusterConfig
from cluster.planner.workload import WorkloadSpec
from loadtests.bench_common import REPO
from loadtests.goodput_results import SLO
from loadtests.plan_validation import arrivals, shape, slo_of, validate, workload_spec
from tests.support.planner_profiles import known_profile

pytestmark = pytest.mark.timeout(60)
SLO_DOC = {"ttft_ms": {"chat": 2000.0, "long": 30000.0}, "tpot_ms": 500.0, "reason": "test"}


def _doc(measured: list[float]) -> dict[str, object]:
    spread = [["chat", 0.0, 1, 1, True], ["long", 30.0, 1, 1, True], ["chat", 60.0, 1, 1, True]]
    return {"created": "then", "setup": {"sweep": {"profile": "goodput"}},
            "results": {"slo": SLO_DOC, "servers": {"default": {"rates": [
                {"rate_rps": 0.05, "attainment": m, "samples": spread} for m in measured]}}}}


def test_the_sweeps_kinds_slos_and_shape_become_the_planners(tmp_path) -> None:  # type: ignore[no-untyped-def]
    got = arrivals([["long", 2.5, 0, 0, True], ["chat", 1.0, 0, 0, True]], "goodput")
    # the profile's prompt tokens already count the chat template: counted once
    assert [(a.t, a.prompt_tokens, a.output_tokens) for a in got] == [(1.0, 60, 48), (2.5, 1400, 48)]
    cfg = ClusterConfig.from_yaml(REPO / "deploy/bench-disaggregated.yaml")
    sh = shape(cfg, conditional=True)
    assert (sh.prefill_replicas, sh.decode_replicas, sh.conditional) == (cfg.prefill.num_replicas,
                                                                        cfg.decode.num_replicas, True)
    assert not shape(cfg, conditional=False).conditional
    colocated = shape(ClusterConfig.from_yaml(REPO / "deploy/bench-colocated.yaml"), conditional=True)
    assert colocated.prefill_replicas == 0 and not colocated.tpot_budget
    path = tmp_path / "workload.yaml"
    path.write_text(yaml.safe_dump(workload_spec(slo_of(_doc([1.0])), "goodput")))
    spec = WorkloadSpec.load(path)  # the planner's own loader is the oracle
    chat = spec.built_objectives().classify(60)
    assert chat is not None and (chat.name, chat.ttft_s, chat.tpot_s) == ("chat", 2.0, 0.5)
    assert spec.mix is not None and [(m.share, m.prompt.fixed) for m in spec.mix] == [(0.85, 60), (0.15, 1400)]
    assert slo_of(_doc([1.0])) == SLO(2000.0, 30000.0, 500.0, "test")


def test_predicted_beside_measured_and_the_tolerance_judged() -> None:
    cfg = ClusterConfig.from_yaml(REPO / "deploy/bench-disaggregated.yaml")
    # three lone requests a long way apart, objectives a fast replica meets: predicted 100%
    ok = validate(_doc([1.0, 0.95]), "default", known_profile(), cfg, conditional=True)
    assert [r["predicted"] for r in ok["rates"]] == [1.0, 1.0]
    assert [r["diff_points"] for r in ok["rates"]] == [0.0, 5.0] and ok["within_tolerance"]
    off = validate(_doc([1.0, 0.5]), "default", known_profile(), cfg, conditional=False)
    assert not off["within_tolerance"] and off["rates"][1]["diff_points"] == 50.0
    assert ok["profile"]["source"] == "measured" and ok["shape"]["conditional"] and not off["shape"]["conditional"]
