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

from loadtests import bench_interference as bi
from loadtests.bench_common import RequestRecord, summarize, write_result
from loadtests.profiles import CHAT_TEMPLATE_TOKENS, PROFILES, make_prompt
from loadtests.schemas import INTERFERENCE_SCHEMA

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
    runs = {"default": _mode_run(0.0, rng), "colocated": _mode_run(2.0, rng),
            "colocated-chunked": _mode_run(0.3, rng), "disaggregated": _mode_run(0.0, rng)}
    doc = bi.build_doc(runs, bi.Plan(), CONFIGS, MACHINE, note="synthetic")
    path = write_result(tmp_path / "interference.json", doc, INTERFERENCE_SCHEMA)
    assert json.loads(path.read_text())["benchmark"] == "interference"
    mixed = doc["results"]["modes"]["disaggregated"]["phases"]["mixed"]
    assert mixed["long_sent"] == 2 and mixed["long_first_token"] == 1
    assert {t["name"] for t in doc["results"]["targets"]} == {
        "default_chat_ttft", "default_isolation", "disaggregated_isolation", "colocated_vs_disaggregated",
        "chunked_vs_disaggregated"}
    assert all(t["met"] is not None for t in doc["results"]["targets"])
    assert bi.plot(doc, tmp_path / "interference.png").stat().st_size > 10_000


def test_interference_targets_without_a_mode_are_unknown_not_failed() -> None:
    doc = bi.build_doc({"disaggregated": _mode_run(0.0, random.Random(1))}, bi.Plan(), CONFIGS, MACHINE)
    jsonschema.validate(doc, INTERFERENCE_SCHEMA)
    by_name = {t["name"]: t for t in doc["results"]["targets"]}
    assert by_name["colocated_vs_disaggregated"]["met"] is None


def test_default_targets_compare_its_mixed_phase_with_its_chat_only_phase() -> None:
    run = _mode_run(0.0, random.Random(3))
    for r in run.chat:  # chat prompts sent in the mixed phase wait three times as long for their first token
        if r.sent >= run.mixed_start:
            shift = 0.4
            r.arrivals[:] = [a + shift for a in r.arrivals]
            r.end = None if r.end is None else r.end + shift
    res = bi.mode_result(run)
    by = {t["name"]: t for t in bi.targets({"default": res})}
    alone, mixed = (res["phases"][p]["chat_ttft_ms"]["p50"] for p in ("chat_only", "mixed"))
    assert by["default_chat_ttft"]["value"] == pytest.approx(mixed / alone, abs=1e-3)
    assert mixed == pytest.approx(600.0, abs=1.0) and alone == pytest.approx(200.0, abs=1.0)
    assert by["default_chat_ttft"]["met"] is False
    assert by["default_isolation"]["value"] == pytest.approx(res["mixed_p99_itl_ms"] / res["chat_only_p99_itl_ms"],
                                                             abs=1e-3)
    assert by["disaggregated_isolation"]["met"] is None


def test_schema_rejects_a_missing_header_field() -> None:
    doc = bi.build_doc({"disaggregated": _mode_run(0.0, random.Random(2))}, bi.Plan(), CONFIGS, MACHINE)
    del doc["setup"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(doc, INTERFERENCE_SCHEMA)


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
