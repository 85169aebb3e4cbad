"""`loadtests.soak` end to end for one minute with the tiny model: it starts, soaks, cleans up, reports.

The soak runs as a subprocess (``python -m loadtests.soak``) exactly as ``make soak`` does, but on a
copy of ``deploy/local.yaml`` that serves the tiny model, for one minute at 2 requests/s with short
outputs. The test checks the JSON it writes (zero errors, per-minute figures, the RSS of
every replica, books whole at idle) and that no process of the server it started outlives it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import yaml

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]


def test_one_minute_soak_writes_its_report(tiny_model: str, tmp_path: Path) -> None:
    doc = yaml.safe_load((REPO / "deploy" / "local.yaml").read_text())
    args = doc["applications"][0]["args"]
    args.update(model=tiny_model, served_model_name="tiny")
    config = tmp_path / "soak-tiny.yaml"
    config.write_text(yaml.safe_dump(doc))
    out = tmp_path / "soak.json"
    before = {p.pid for p in psutil.process_iter()}
    cmd = [sys.executable, "-m", "loadtests.soak", "--config", str(config), "--minutes", "1", "--users", "2",
           "--rate", "2", "--max-tokens", "16", "--out", str(out)]
    proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "RAY_AUTH_MODE": "disabled"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait(30)
    text = log.decode(errors="replace")
    assert proc.returncode == 0, text[-3000:]
    report = json.loads(out.read_text())
    # (the soak validates the document against its SOAK_SCHEMA before writing it; importing
    # loadtests.soak here would let locust gevent-patch this test process)
    assert report["benchmark"] == "soak" and report["setup"]["minutes"] == 1
    r = report["results"]
    assert r["errors"] == 0 and r["passed"] and r["requests"] >= 60, r
    (minute,) = r["per_minute"]
    assert minute["ttft_p99_ms"] is not None and minute["itl_p99_ms"] is not None
    assert {k.split(":")[0] for k in minute["rss_mib"]} == {"router", "prefill", "decode"}
    assert r["idle_books"] and not any(r["idle_books"].values()), r["idle_books"]
    print(f"soak (1 min, tiny model): {r['requests']} requests, TTFT p99 {minute['ttft_p99_ms']} ms, "
          f"ITL p99 {minute['itl_p99_ms']} ms, RSS {minute['rss_mib']}")
    leftovers = []
    for p in psutil.process_iter():
        if p.pid in before:
            continue
        try:
            if "ServeReplica:pdserve" in " ".join(p.cmdline()) or "pdserve serve" in " ".join(p.cmdline()):
                leftovers.append(p.pid)
        except psutil.Error:
            pass
    assert not leftovers, f"processes of the soak's server outlived it: {leftovers}"
