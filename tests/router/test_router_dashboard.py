"""deploy/grafana/pdserve-dashboard.json asks only for what the router's /metrics exports: every metric
name in a query is a sample the registry renders, every label a query groups or filters by is one of
that sample's labels; and the objectives' and path decisions' counters count what they say."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from engine.load_report import LoadReport
from router import loadboard
from router.metrics import RouterMetrics
from router.objectives import SLOClass
from router.path_policy import Path as RoutePath
from router.path_policy import PathDecision, PathEstimates, Reason

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy/grafana/pdserve-dashboard.json"
NAME = re.compile(r"pdserve:[A-Za-z0-9_:]+")
GROUPING = re.compile(r"\bby \(([^)]*)\)")
MATCHER = re.compile(r"\{([^}]*)\}")
CHAT = SLOClass("chat", ttft_s=0.5, tpot_s=0.1, max_prompt_tokens=256)


def _exported() -> dict[str, set[str]]:
    """Every sample name the router renders, with its label names (one of each labelled family recorded)."""
    loadboard.publish("dash-decode", {"d": LoadReport("d", "decode", 1, 2, 3, 4, 5)})
    loadboard.publish("dash-prefill", {"p": LoadReport("p", "prefill", 1, 2, 3, 4, 5)})
    m = RouterMetrics(["dash-decode", "dash-prefill"])
    m.success.labels("stop").inc()
    m.record_slo(CHAT, RoutePath.LOCAL, 0.2, 0.05)
    m.record_decision(PathDecision(RoutePath.LOCAL, Reason.SHORT, PathEstimates(30, 512, 0.05, 0.2)))
    out: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(generate_latest(m.registry).decode()):
        for s in family.samples:
            out.setdefault(s.name, set()).update(s.labels)
    return out


def _problems(expr: str, exported: dict[str, set[str]]) -> list[str]:
    names = NAME.findall(expr)
    bad = [f"{n}: not exported" for n in names if n not in exported]
    labels = set().union(*(exported.get(n, set()) for n in names), {"le"})
    used = {x.strip() for g in GROUPING.findall(expr) for x in g.split(",") if x.strip()}
    used |= {m.split("=")[0].strip().rstrip("!~") for g in MATCHER.findall(expr) for m in g.split(",") if m.strip()}
    bad += [f"label {u}: not on {names}" for u in sorted(used - labels)]
    return bad if names else [f"{expr}: names no pdserve metric"]


def test_every_dashboard_query_names_exported_metrics_and_labels() -> None:
    exported = _exported()
    panels = json.loads(DASHBOARD.read_text())["panels"]
    exprs = [t["expr"] for p in panels for t in p["targets"]]
    assert len(exprs) >= 20
    bad = {e: p for e in exprs if (p := _problems(e, exported))}
    assert not bad, bad
    # the check itself bites: a misspelt name and a label the metric lacks are both reported
    assert _problems('sum by (pool) (pdserve:kv_blocks_usedd)', exported) == [
        "pdserve:kv_blocks_usedd: not exported", "label pool: not on ['pdserve:kv_blocks_usedd']"]


@pytest.mark.parametrize(("ttft", "tpot", "attained"), [(0.2, 0.05, "true"), (0.6, 0.05, "false"),
                                                        (0.2, 0.2, "false"), (0.5, None, "true")])
def test_slo_counter_counts_by_class_path_and_attainment(ttft: float, tpot: float | None, attained: str) -> None:
    m = RouterMetrics()
    m.record_slo(CHAT, RoutePath.REMOTE, ttft, tpot)
    text = generate_latest(m.registry).decode()
    assert f'pdserve:slo_requests_total{{attained="{attained}",path="remote",slo_class="chat"}} 1.0' in text


def test_path_decisions_are_counted_by_path_and_reason() -> None:
    m = RouterMetrics()
    d = PathDecision(RoutePath.REMOTE, Reason.NO_HEADROOM, PathEstimates(100, 0, float("inf"), 0.3))
    m.record_decision(d)
    m.record_decision(d)
    text = generate_latest(m.registry).decode()
    assert 'pdserve:path_decisions_total{path="remote",reason="no_headroom"} 2.0' in text
