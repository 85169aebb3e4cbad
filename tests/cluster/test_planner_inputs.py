"""`cluster.planner.profile` and `.workload`: the profile JSON, the fitted models, the workload spec and
its arrivals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from cluster.planner.profile import ReplicaProfile, fit
from cluster.planner.workload import WorkloadSpec, arrivals
from tests.support.planner_profiles import PREFILL, STEP, known_profile, spec

pytestmark = pytest.mark.timeout(60)
REPO = Path(__file__).resolve().parents[2]


def test_fits_recover_the_models_the_points_came_from() -> None:
    fp = fit(known_profile())
    for got, want in [(fp.prefill.base_s, PREFILL.base_s), (fp.prefill.per_token_s, PREFILL.per_token_s),
                      (fp.prefill.per_pair_s, PREFILL.per_pair_s), (fp.step.base_s, STEP.base_s),
                      (fp.step.per_seq_s, STEP.per_seq_s), (fp.step.per_context_token_s, STEP.per_context_token_s)]:
        assert got == pytest.approx(want, rel=1e-6)
    assert fp.step.per_prefill_token_s == pytest.approx(PREFILL.per_token_s, rel=1e-6)
    assert fp.transfer_s(1000) == pytest.approx(1000 * 1000 / 1e8)


def test_a_fit_never_has_negative_coefficients() -> None:
    # decode times that fall with context: the least-squares slope would be negative, so it is dropped
    p = known_profile()
    falling = tuple(type(d)(d.batch, d.context, 0.05 - 1e-6 * d.context) for d in p.decode)
    fp = fit(ReplicaProfile(**{**vars(p), "decode": falling}))
    assert fp.step.per_context_token_s == 0.0 and fp.step.base_s > 0


def test_profile_json_round_trip_and_refusals(tmp_path: Path) -> None:
    p = known_profile()
    p.save(tmp_path / "p.json")
    assert ReplicaProfile.load(tmp_path / "p.json") == p
    data = json.loads((tmp_path / "p.json").read_text())
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['gpu'\]"):
        ReplicaProfile.from_json({**data, "gpu": "h100"})
    with pytest.raises(ValueError, match="format must be"):
        ReplicaProfile.from_json({**data, "format": "other/1"})
    with pytest.raises(ValueError, match="source must be"):
        ReplicaProfile.from_json({**data, "source": "guess"})


def test_the_shipped_gpu_profile_is_labelled_a_roofline_estimate() -> None:
    p = ReplicaProfile.load(REPO / "deploy/profiles/h100-llama3-8b-roofline.json")
    assert p.source == "roofline estimate" and "NOT A MEASUREMENT" in p.notes and "roofline" in p.label
    from loadtests.roofline_profile import profile

    assert profile() == p  # the file is what its generator writes


def test_arrivals_are_seeded_poisson_at_the_rate() -> None:
    s = spec(requests=2000)
    a, b = arrivals(s, 10.0), arrivals(s, 10.0)
    assert a == b and len(a) == 2000
    assert 2000 / a[-1].t == pytest.approx(10.0, rel=0.1)
    assert [x.prompt_tokens for x in arrivals(s, 50.0)] == [x.prompt_tokens for x in a]  # same mix at any rate
    long = sum(x.prompt_tokens == 600 for x in a) / len(a)
    assert long == pytest.approx(0.2, abs=0.05)


def test_a_trace_is_rescaled_to_the_rate(tmp_path: Path) -> None:
    lines = [{"t": 10 + 2 * i, "prompt_tokens": 5 + i, "output_tokens": 3} for i in range(11)]
    (tmp_path / "t.jsonl").write_text("\n".join(json.dumps(x) for x in lines))
    (tmp_path / "w.yaml").write_text("objectives: {classes: [{name: a, ttft_s: 1, tpot_s: 1}]}\ntrace: t.jsonl\n")
    s = WorkloadSpec.load(tmp_path / "w.yaml")
    got = arrivals(s, 5.0)  # 10 gaps in 20 s (0.5/s) → 10 gaps in 2 s
    assert got[0].t == 0 and got[-1].t == pytest.approx(2.0) and [x.prompt_tokens for x in got] == list(range(5, 16))


@pytest.mark.parametrize(("change", "needle"), [
    ({"mixx": []}, "mixx"),
    ({"trace": "x.jsonl"}, "exactly one of mix, trace"),
    ({"objectives": {"classes": []}}, "needs objectives"),
    ({"mix": [{"share": 1, "prompt": {"fixed": 3, "uniform": [1, 2]}, "output": {"fixed": 1}}]},
     "exactly one of fixed"),
])
def test_bad_workloads_are_refused_naming_the_problem(change: dict[str, object], needle: str) -> None:
    with pytest.raises(ValidationError, match=needle):
        spec(**change)


def test_a_bad_workload_file_names_the_file_and_key(tmp_path: Path) -> None:
    (tmp_path / "w.yaml").write_text("objectives: {classes: [{name: a, ttft_s: 1, tpot_s: 1}]}\nmix: []\nrate: 3\n")
    with pytest.raises(ValueError, match=r"(?s)w\.yaml: invalid workload.*rate: unknown key \(allowed: objectives,"):
        WorkloadSpec.load(tmp_path / "w.yaml")


def test_the_window_sets_the_arrivals_and_too_many_are_refused() -> None:
    s = spec(requests=10, duration_s=20.0, max_requests=500)
    got = arrivals(s, 5.0)
    assert got[-1].t < 20.0 and len(got) == pytest.approx(100, rel=0.3)  # the window, not the minimum
    assert len(arrivals(s, 0.1)) == 10  # a slow rate: the minimum
    with pytest.raises(ValueError, match="past max_requests 500"):
        arrivals(s, 100.0)
