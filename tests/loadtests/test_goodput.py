"""The goodput benchmark's pure pieces on synthetic requests: schedule, objectives, attainment, knee,
targets, the server YAMLs it writes, the counters it reads, and a whole result document against its schema."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import yaml
from prometheus_client import CollectorRegistry, Counter, generate_latest

from cluster.config import ClusterConfig
from loadtests import bench_goodput as gp
from loadtests.bench_common import REPO, RequestRecord
from loadtests.goodput_results import SLO, Baseline, RateRun, knee, rate_point, table, targets
from loadtests.goodput_schedule import Sweep, schedule
from loadtests.goodput_schema import GOODPUT_SCHEMA
from loadtests.goodput_servers import SERVERS, bench_yaml, counts_between, parse_labelled, pick

pytestmark = pytest.mark.timeout(60)
SLO_MS = SLO(chat_ttft_ms=500.0, long_ttft_ms=5000.0, tpot_ms=100.0, source="test")
MACHINE = {"cpu": "synthetic", "cpus": 2}


def _rec(kind: str, sent: float, ttft: float, gaps: list[float], finished: bool = True) -> RequestRecord:
    rec = RequestRecord(kind=kind, prompt_tokens=60, max_tokens=len(gaps) + 1, sent=sent)
    t = sent + ttft
    rec.arrivals.append(t)
    for g in gaps:
        t += g
        rec.arrivals.append(t)
    if finished:
        rec.end, rec.usage_tokens = t, len(rec.arrivals)
    return rec


def test_schedule_is_seeded_stratified_and_long_enough() -> None:
    a, b = schedule(2.0, 100.0, "goodput", seed=3), schedule(2.0, 100.0, "goodput", seed=3)
    assert [(x.at_s, x.body) for x in a] == [(x.at_s, x.body) for x in b]
    assert [x.at_s for x in schedule(2.0, 100.0, "goodput", seed=4)] != [x.at_s for x in a]
    assert 120 < len(a) < 280 and sum(x.workload.name == "long" for x in a) == round(0.15 * len(a))
    assert all(x.at_s < 100.0 for x in a) and [x.at_s for x in a] == sorted(x.at_s for x in a)
    assert {(x.workload.prompt_tokens, x.body["max_tokens"]) for x in a} == {(60, 48), (1400, 48)}
    sweep = Sweep(duration_s=60.0, min_requests=40)
    assert (sweep.window_s(0.25), sweep.window_s(1.0)) == (160.0, 60.0)


def test_sweep_refuses_what_it_cannot_run() -> None:
    with pytest.raises(ValueError, match="rates must be positive"):
        Sweep(rates=(0.5, 0.0))
    with pytest.raises(ValueError, match="unknown profile 'nope'"):
        Sweep(profile="nope")


def test_objectives_scale_the_lone_baseline_and_judge_each_request() -> None:
    slo = SLO.from_baseline(Baseline(chat_ttft_ms=151.0, long_ttft_ms=2333.0, chat_tpot_ms=41.0, server="remote"))
    assert (slo.chat_ttft_ms, slo.long_ttft_ms, slo.tpot_ms) == (450.0, 7000.0, 120.0)
    assert "remote" in slo.source
    assert SLO_MS.attained(_rec("chat", 0.0, 0.4, [0.09] * 5))
    assert not SLO_MS.attained(_rec("chat", 0.0, 0.6, [0.09] * 5))  # TTFT over
    assert not SLO_MS.attained(_rec("chat", 0.0, 0.4, [0.2] * 5))  # TPOT over
    assert SLO_MS.attained(_rec("long", 0.0, 4.0, [0.09] * 5))  # the long class's TTFT
    assert SLO_MS.attained(_rec("chat", 0.0, 0.4, []))  # one token: no TPOT to miss
    assert not SLO_MS.attained(_rec("chat", 0.0, 0.4, [0.01], finished=False))  # cut at the drain
    with pytest.raises(ValueError, match="'other'"):
        SLO_MS.ttft_ms("other")


def test_rate_point_counts_every_request_sent_by_class() -> None:
    run = RateRun(rate=0.5, window_s=10.0, t0=0.0, records=[
        _rec("chat", 1.0, 0.2, [0.05] * 4), _rec("chat", 2.0, 0.9, [0.05] * 4),
        _rec("long", 3.0, 4.0, [0.05] * 4), _rec("chat", 9.0, 0.2, [0.05], finished=False)])
    p = rate_point(run, SLO_MS)
    assert (p["sent"], p["finished"], p["attained"], p["attainment"]) == (4, 3, 2, 0.5)
    assert p["classes"]["chat"]["sent"] == 3 and p["classes"]["chat"]["attained"] == 1
    assert p["classes"]["long"]["attainment"] == 1.0 and p["goodput_rps"] == 0.2
    assert p["ttft_ms"]["n"] == 4 and p["itl_ms"]["p50"] == pytest.approx(50.0)
    assert p["samples"][3] == ["chat", 9.0, 200.0, None, False]


def test_knee_is_where_every_rate_up_to_it_held() -> None:
    def pts(*att: float) -> list[dict[str, float]]:
        return [{"rate_rps": 0.1 * (i + 1), "attainment": a} for i, a in enumerate(att)]

    assert knee(pts(1.0, 0.9, 0.85, 0.95)) == pytest.approx(0.2)  # a lucky point past a miss does not count
    assert knee(pts(0.5, 1.0)) is None
    assert knee(pts(1.0, 1.0, 1.0)) == pytest.approx(0.3)


def _server(atts: dict[float, float], k: float | None) -> dict[str, object]:
    return {"rates": [{"rate_rps": r, "attainment": a} for r, a in atts.items()], "knee_rps": k}


def test_targets_judge_the_default_against_each_server() -> None:
    servers = {"default": _server({0.25: 1.0, 0.5: 0.9}, 0.5), "vllm": _server({0.25: 0.95, 0.5: 0.6}, 0.25),
               "colocated-chunked": _server({0.25: 1.0, 0.5: 0.95}, 0.5)}
    by = {t["name"]: t for t in targets(servers)}
    assert by["attainment_vs_vllm"]["value"] == pytest.approx(0.05) and by["attainment_vs_vllm"]["met"]
    assert by["attainment_vs_colocated-chunked"]["value"] == pytest.approx(-0.05)
    assert by["attainment_vs_colocated-chunked"]["met"] is False
    assert (by["knee_vs_vllm"]["value"], by["knee_vs_vllm"]["met"]) == (2.0, True)
    assert (by["knee_vs_colocated-chunked"]["value"], by["knee_vs_colocated-chunked"]["met"]) == (1.0, False)
    missing = {t["name"]: t for t in targets({"default": _server({0.25: 1.0}, 0.25)})}
    assert missing["knee_vs_vllm"]["met"] is None  # vLLM did not run: nothing to judge
    never = {t["name"]: t for t in targets({"default": _server({0.25: 0.5}, None), "vllm": _server({}, None)})}
    assert never["knee_vs_vllm"]["met"] is False


def test_bench_yaml_gives_every_server_the_objectives_and_the_dtype(tmp_path: Path) -> None:
    for spec in (SERVERS["default"], SERVERS["remote"], SERVERS["colocated-chunked"]):
        assert spec.config is not None
        doc = bench_yaml(yaml.safe_load((REPO / spec.config).read_text()), SLO_MS.objectives_section("goodput"),
                         "float32", spec.prefill_path)
        path = tmp_path / f"{spec.name}.yaml"
        path.write_text(yaml.safe_dump(doc))
        cfg = ClusterConfig.from_yaml(path)  # the real config loader is the oracle
        obj = cfg.objectives.build()
        chat, long = obj.classify(60), obj.classify(1400)
        assert chat is not None and (chat.name, chat.ttft_s, chat.tpot_s) == ("chat", 0.5, 0.1)
        assert long is not None and (long.name, long.ttft_s) == ("long", 5.0)
        assert cfg.engine.dtype == "float32"
        if spec.prefill_path is not None:  # default and remote: one layout, the path apart
            assert cfg.router.prefill_path == spec.prefill_path
    with pytest.raises(ValueError, match="unknown server 'nope'"):
        pick("default,nope")


def test_labelled_counters_are_read_from_a_prometheus_page() -> None:
    reg = CollectorRegistry()
    c = Counter("pdserve:path_decisions", "decisions", ["path", "reason"], registry=reg)
    c.labels("local", "short").inc(3)
    c.labels("remote", "remote_meets").inc()
    page = generate_latest(reg).decode()
    before = parse_labelled(page, "pdserve:path_decisions_total", ("path", "reason"))
    assert before == {"local/short": 3.0, "remote/remote_meets": 1.0}
    c.labels("local", "short").inc(2)
    after = parse_labelled(generate_latest(reg).decode(), "pdserve:path_decisions_total", ("path", "reason"))
    assert counts_between(before, after) == {"local/short": 2.0}
    assert counts_between(None, after) is None


def test_goodput_doc_matches_its_schema_prints_and_plots(tmp_path: Path) -> None:
    sweep = Sweep(rates=(0.5, 1.0), duration_s=10.0, min_requests=1)
    runs = []
    for name, ttft in (("default", 0.2), ("colocated-chunked", 0.7), ("vllm", 0.3)):
        run = gp.ServerRun(SERVERS[name])
        for rate in sweep.rates:
            r = RateRun(rate=rate, window_s=sweep.window_s(rate), path_decisions={"local/short": 3.0})
            r.records = [_rec(a.workload.name, a.at_s, ttft * rate, [0.05] * 5) for a in
                         schedule(rate, r.window_s, sweep.profile, sweep.seed)]
            run.rates.append(r)
        runs.append(run)
    runs.append(gp.ServerRun(SERVERS["remote"], skipped="no YAML"))
    base = Baseline(100.0, 1000.0, 40.0, "remote")
    doc = gp.build_doc(runs, SLO.from_baseline(base), base, sweep, "float32", MACHINE)
    jsonschema.validate(doc, GOODPUT_SCHEMA)
    servers = doc["results"]["servers"]
    assert servers["default"]["knee_rps"] == 1.0 and servers["colocated-chunked"]["knee_rps"] is None
    assert servers["remote"]["skipped"] == "no YAML" and servers["remote"]["rates"] == []
    assert json.loads(json.dumps(doc)) == doc
    text = table(servers)
    assert "default" in text.splitlines()[2] and text.splitlines()[2].rstrip().endswith("1")
    assert gp.plot(doc, tmp_path / "goodput.png").stat().st_size > 10_000
    del doc["results"]["servers"]["default"]["knee_rps"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(doc, GOODPUT_SCHEMA)
