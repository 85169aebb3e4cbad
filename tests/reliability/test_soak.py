"""`loadtests.soak` end to end for one minute with the tiny model: it starts, soaks, cleans up, reports.

The soak runs as a subprocess (``python -m loadtests.soak``) exactly as ``make soak`` does, but on a
copy of ``deploy/local.yaml`` that serves the tiny model, for one minute at 2 requests/s with short
outputs (`tests.support.soak_run`). To keep the package's wall time down, `start_soak` is called by
a package fixture when the package starts (only if this test was collected), so the soak's minute
overlaps the other tests; this test, which runs last, waits for it. It checks the JSON the soak
writes (zero errors, per-minute figures, the RSS of every replica, books whole at idle) and that no
process of the server the soak started outlives it (the server runs in a session of its own, and every
process Ray starts for it stays in that session; other tests' servers are in others). Its RSS-growth
check needs more than one minute to judge anything; `loadtests.soak.judge_rss` is unit-tested in
tests/loadtests/test_soak_judgement.py.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import jsonschema
import psutil
import pytest

from loadtests.soak import SOAK_SCHEMA
from tests.support.soak_run import SoakRun, start_soak

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_one_minute_soak_writes_its_report(background_soak: SoakRun | None, tiny_model: str, tmp_path: Path) -> None:
    run = background_soak or start_soak(tiny_model, tmp_path)
    rc = run.wait(timeout_s=260)
    text = run.log.read_text(errors="replace")
    assert rc == 0, text[-3000:]
    report = json.loads(run.out.read_text())
    jsonschema.validate(report, SOAK_SCHEMA)
    assert report["benchmark"] == "soak" and report["setup"]["minutes"] == 1
    r = report["results"]
    assert r["errors"] == 0 and r["passed"] and r["requests"] >= 60, r
    (minute,) = r["per_minute"]
    assert minute["ttft_p99_ms"] is not None and minute["itl_p99_ms"] is not None
    assert {k.split(":")[0] for k in minute["rss_mib"]} == {"router", "prefill", "decode"}
    # one minute leaves nothing after minute 1 to judge RSS growth on: the judgement says so (it is
    # proven able to fail in tests/loadtests/test_soak_judgement.py)
    assert r["max_rss_growth_pct"] is None and not any(r["rss_growth_pct"].values()), r["rss_growth_pct"]
    assert r["idle_books"] and not any(r["idle_books"].values()), r["idle_books"]
    print(f"soak (1 min, tiny model, alongside the other tests): {r['requests']} requests, TTFT p99 "
          f"{minute['ttft_p99_ms']} ms, ITL p99 {minute['itl_p99_ms']} ms, RSS {minute['rss_mib']}")
    # the server's processes are those of its session (it is started in a session of its own, and Ray's
    # processes stay in the session of the process that started them); other tests' servers are not
    server_sid = report["setup"]["server_pid"]
    deadline = time.monotonic() + 10.0  # a process killed on the way out may take a moment to go
    while (leftovers := _session(server_sid)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not leftovers, f"processes of the soak's server outlived it: {leftovers}"


def _session(sid: int) -> list[tuple[int, str]]:
    """(pid, command) of every live process in session ``sid``."""
    out = []
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) == sid and p.status() != psutil.STATUS_ZOMBIE:
                out.append((p.pid, " ".join(p.cmdline())[:80]))
        except (psutil.Error, ProcessLookupError, PermissionError):
            pass
    return out
