"""The benchmark result writers on synthetic samples: documents match the schemas, plots are written.

Numbers are not asserted beyond bookkeeping (what falls in which phase, which SLO a request met):
the point is that `make bench` cannot write a file its schema rejects. Also: profile prompts have
the token counts they claim (checked with the real SmolLM2 tokenizer), and the percentile helper.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import jsonschema
import pytest

from loadtests import bench_goodput as gp
from loadtests import bench_interference as bi
from loadtests.bench_common import RequestRecord, summarize, write_result
from loadtests.profiles import CHAT_TEMPLATE_TOKENS, PROFILES, make_prompt
from loadtests.schemas import GOODPUT_SCHEMA, INTERFERENCE_SCHEMA

MACHINE = {"cpu": "synthetic", "cpus": 2}
CONFIGS = {m: {"path": p, "yaml": {"applications": []}} for m, p in bi.MODES.items()}


def _record(kind: str, sent: float, gaps: list[float], user: int = 0, finished: bool = True) -> RequestRecord:
    rec = RequestRecord(kind=kind, prompt_tokens=100, max_tokens=len(gaps) + 1, sent=sent, user=user)
    t = sent + 0.2
    rec.arrivals.append(t)
    for g in gaps:
        t += g
        rec.arrivals.append(t)
    if finished:
        rec.end, rec.usage_tokens = t + 0.001, len(rec.arrivals)
    return rec


def _mode_run(stall_s: float, rng: random.Random) -> bi.ModeRun:
    run = bi.ModeRun(t0=0.0, chat_only_start=1.0, mixed_start=6.0, end=12.0)
    for u in range(3):
        t = rng.uniform(0, 0.5)
        while t < 12:
            gaps = [0.05 + (stall_s if 6 < t + i * 0.05 < 6.1 else 0) for i in range(20)]
            rec = _record("chat", t, gaps, user=u, finished=t + 1.5 + stall_s < 12)
            run.chat.append(rec)
            t = rec.arrivals[-1] + 0.01
    run.long = [_record("long", 6.0, [0.05] * 5), _record("long", 9.0, [], finished=False)]
    run.long[1].arrivals.clear()
    return run


def test_interference_doc_matches_schema_and_plots(tmp_path: Path) -> None:
    rng = random.Random(0)
    runs = {"colocated": _mode_run(2.0, rng), "colocated-chunked": _mode_run(0.3, rng),
            "disaggregated": _mode_run(0.0, rng)}
    doc = bi.build_doc(runs, bi.Plan(), CONFIGS, MACHINE, note="synthetic")
    path = write_result(tmp_path / "interference.json", doc, INTERFERENCE_SCHEMA)
    assert json.loads(path.read_text())["benchmark"] == "interference"
    mixed = doc["results"]["modes"]["disaggregated"]["phases"]["mixed"]
    assert mixed["long_sent"] == 2 and mixed["long_first_token"] == 1
    assert {t["name"] for t in doc["results"]["targets"]} == {
        "disaggregated_isolation", "colocated_vs_disaggregated", "chunked_vs_disaggregated"}
    assert all(t["met"] is not None for t in doc["results"]["targets"])
    assert bi.plot(doc, tmp_path / "interference.png").stat().st_size > 10_000


def test_interference_targets_without_a_mode_are_unknown_not_failed() -> None:
    doc = bi.build_doc({"disaggregated": _mode_run(0.0, random.Random(1))}, bi.Plan(), CONFIGS, MACHINE)
    jsonschema.validate(doc, INTERFERENCE_SCHEMA)
    by_name = {t["name"]: t for t in doc["results"]["targets"]}
    assert by_name["colocated_vs_disaggregated"]["met"] is None


def test_goodput_doc_matches_schema_and_plots(tmp_path: Path) -> None:
    plan = gp.Plan(rates=(0.5, 1.0), window_s=10.0)
    runs = {}
    for mode, tpot in (("colocated-chunked", 0.08), ("disaggregated", 0.05)):
        m = gp.ModeRun(baseline={"chat_ttft_ms": 200.0, "chat_tpot_ms": 40.0, "long_ttft_ms": 4000.0})
        for rate in plan.rates:
            r = gp.RateRun(rate=rate, window_s=plan.window_s)
            for a in gp.schedule(rate, plan.window_s, "mixed", seed=0):
                r.records.append(_record(a.workload.name, a.at_s, [tpot] * 7))
            r.records.append(_record("chat", 9.5, [0.05] * 3, finished=False))  # cut at the drain
            m.rates.append(r)
        runs[mode] = m
    doc = gp.build_doc(runs, plan, CONFIGS, MACHINE)
    write_result(tmp_path / "goodput.json", doc, GOODPUT_SCHEMA)
    slo = doc["results"]["slo"]
    assert slo["ttft_ms"] == {"chat": 1000.0, "long": 20000.0} and slo["tpot_ms"] == 120.0
    point = doc["results"]["modes"]["disaggregated"]["rates"][0]
    assert point["sent"] == point["finished"] + 1
    assert point["attainment"] == pytest.approx((point["sent"] - 1) / point["sent"], abs=1e-3)
    assert gp.plot(doc, tmp_path / "goodput.png").stat().st_size > 10_000


def test_schema_rejects_a_missing_header_field() -> None:
    doc = bi.build_doc({"disaggregated": _mode_run(0.0, random.Random(2))}, bi.Plan(), CONFIGS, MACHINE)
    del doc["setup"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(doc, INTERFERENCE_SCHEMA)


def test_poisson_schedule_is_seeded_and_mixed() -> None:
    a, b = gp.schedule(2.0, 100.0, "mixed", seed=3), gp.schedule(2.0, 100.0, "mixed", seed=3)
    assert [(x.at_s, x.body) for x in a] == [(x.at_s, x.body) for x in b]
    assert 120 < len(a) < 280 and sum(x.workload.name == "long" for x in a) == round(0.1 * len(a))
    for rate in (0.25, 0.5, 1.0):  # short windows still hold a long prompt
        arrivals = gp.schedule(rate, 30.0, "mixed", seed=0)
        assert len(arrivals) < 2 or any(x.workload.name == "long" for x in arrivals)


def test_summarize_nearest_rank() -> None:
    s = summarize([float(i) for i in range(1, 101)])
    assert (s["n"], s["p50"], s["p99"], s["max"]) == (100, 50.0, 99.0, 100.0)
    assert summarize([])["p99"] is None


def test_profile_prompts_have_their_token_counts() -> None:
    from engine.tokenizer import Tokenizer
    from tests.support.models import bundled_tokenizer_dir

    tok = Tokenizer.from_dir(bundled_tokenizer_dir())
    assert len(tok.encode_chat([{"role": "user", "content": "x"}], add_generation_prompt=True)) == \
        CHAT_TEMPLATE_TOKENS + 1
    for profile in PROFILES.values():
        for w, _ in profile.workloads:
            for seed in range(3):
                text = make_prompt(w.prompt_tokens, random.Random(seed))
                n = len(tok.encode_chat([{"role": "user", "content": text}], add_generation_prompt=True))
                assert abs(n - w.prompt_tokens) <= 0.02 * w.prompt_tokens, (w, n)
