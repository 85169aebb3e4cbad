"""The router's /metrics: per-replica gauges and the decode step counters from the load board."""

from __future__ import annotations

from prometheus_client import generate_latest

from engine.load_report import LoadReport
from router import loadboard
from router.metrics import RouterMetrics


def test_step_counters_come_from_decode_reports_only() -> None:
    decode = LoadReport("d1", "decode", 0, 3, 100, 10, 20, steps=40, step_seconds=1.5, step_cpu_seconds=1.25,
                        step_sequences=120)
    prefill = LoadReport("p1", "prefill", 1, 0, 50, 5, 20, outbox_pending=2, steps=7)
    loadboard.publish("decode-m", {"d1": decode})
    loadboard.publish("prefill-m", {"p1": prefill})
    text = generate_latest(RouterMetrics(["decode-m", "prefill-m"]).registry).decode()
    assert 'pdserve:engine_steps_total{replica="d1",role="decode"} 40.0' in text
    assert 'pdserve:engine_step_seconds_total{replica="d1",role="decode"} 1.5' in text
    assert 'pdserve:engine_step_cpu_seconds_total{replica="d1",role="decode"} 1.25' in text
    assert 'pdserve:engine_step_sequences_total{replica="d1",role="decode"} 120.0' in text
    assert 'pdserve:kv_outbox_pending{replica="p1",role="prefill"} 2.0' in text
    assert 'engine_steps_total{replica="p1"' not in text


def test_kv_pairs_and_unpaired_pulls_come_from_decode_reports() -> None:
    decode = LoadReport("d2", "decode", 0, 0, 0, 10, 20, kv_pairs=3, kv_pulls_unpaired=1)
    prefill = LoadReport("p2", "prefill", 0, 0, 0, 5, 20, kv_host="10.0.0.2", kv_port=5000)
    loadboard.publish("decode-kv", {"d2": decode})
    loadboard.publish("prefill-kv", {"p2": prefill})
    text = generate_latest(RouterMetrics(["decode-kv", "prefill-kv"]).registry).decode()
    assert 'pdserve:kv_pairs{replica="d2",role="decode"} 3.0' in text
    assert 'pdserve:kv_pulls_unpaired_total{replica="d2",role="decode"} 1.0' in text
    assert 'kv_pairs{replica="p2"' not in text
