"""`PrefillPoolView`: the KV sources a decode replica meets, read from the prefill replicas' load
reports on the board the router's request router writes (`router.loadboard` → `engine.load_report`).

Outside Serve the view watches nothing (no handle) and only reads the board: these tests write the
board as Serve's routing loop would, through the router's own door, and read it as the decode
replica does.
"""

from __future__ import annotations

from decode_worker.prefill_pool import PrefillPoolView
from engine.load_report import LoadReport, kv_sources
from router import loadboard


def prefill(rid: str, host: str = "", port: int = 0, ready: bool = True) -> LoadReport:
    return LoadReport(rid, "prefill", 0, 0, 0, 1, 1, ready=ready, kv_host=host, kv_port=port)


def test_every_reported_source_once_sorted_draining_ones_included() -> None:
    reports = [prefill("p1", "10.0.0.2", 7), prefill("p2", "10.0.0.1", 9, ready=False),
               prefill("p3"),  # has not reported its source yet
               prefill("p4", "10.0.0.2", 7)]  # the same address twice (a restart seen mid-update)
    assert kv_sources(reports) == [("10.0.0.1", 9), ("10.0.0.2", 7)]  # draining p2: its outbox is still pulled


def test_the_view_follows_what_the_router_publishes_for_the_prefill_deployment() -> None:
    view = PrefillPoolView("prefill-view-test")
    assert not view.watching and view.sources() == []  # no Serve here; nothing published yet
    loadboard.publish("prefill-view-test", {"a": prefill("a", "10.0.0.2", 7), "b": prefill("b", "10.0.0.1", 9)})
    assert view.sources() == [("10.0.0.1", 9), ("10.0.0.2", 7)]
    loadboard.publish("prefill-view-test", {"a": prefill("a", "10.0.0.2", 7)})  # b scaled away
    assert view.sources() == [("10.0.0.2", 7)]
    loadboard.publish("another-deployment", {"c": prefill("c", "10.0.0.3", 1)})
    assert view.sources() == [("10.0.0.2", 7)]
