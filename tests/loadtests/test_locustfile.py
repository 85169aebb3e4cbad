"""The locustfile, headless for a few seconds, against a real local Serve app with a tiny model.

What this checks: the custom request types (TTFT, ITL, TPOT, E2E) reach locust's stats CSV with
non-zero counts and no failures, and the HTML report is written — i.e. ``make loadtest`` works.
One Ray cluster for the module (fractional replica CPUs), shut down after; locust runs as a
subprocess in its own process group, killed on timeout.
"""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray
from ray import serve

from cluster.app import compose_app
from cluster.config import ClusterConfig, Environment
from cluster.local import wait_ready
from loadtests.bench_common import free_port
from tests.support.models import make_tiny_chat_model

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(90)]

REPO = Path(__file__).resolve().parents[2]
SERVED = "tiny-chat"


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    model = make_tiny_chat_model(tmp_path_factory.mktemp("model") / "tiny", max_position_embeddings=1024)
    cfg = ClusterConfig.from_args({
        "model": str(model), "served_model_name": SERVED, "mode": "disaggregated",
        "engine": {"num_threads": 1},
        "prefill": {"num_cpus": 0.25, "num_blocks": 128},
        "decode": {"num_cpus": 0.25, "num_blocks": 128},
        "router": {"num_cpus": 0.1},
        "limits": {"max_model_len": 1024},
    }, Environment())
    os.environ["RAY_AUTH_MODE"] = "disabled"
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(compose_app(cfg), name="lt", route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, timeout_s=40)
        yield url
    finally:
        serve.shutdown()
        ray.shutdown()


def _run_locust(args: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    proc = subprocess.Popen([sys.executable, "-m", "locust", *args], cwd=REPO, text=True, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"locust ran past {timeout_s} s:\n{out[-3000:]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, "")


def test_locust_reports_ttft_itl_tpot_e2e(base: str, tmp_path: Path) -> None:
    prefix = tmp_path / "lt"
    res = _run_locust(["-f", "loadtests/locustfile.py", "--headless", "-u", "2", "-r", "2", "--run-time", "8s",
                       "--host", base, "--csv", str(prefix), "--html", str(tmp_path / "report.html"),
                       "--profile", "chat", "--model", SERVED, "--max-tokens", "8", "--only-summary"],
                      timeout_s=45)
    assert res.returncode == 0, res.stdout[-3000:]
    with open(f"{prefix}_stats.csv", newline="") as f:
        rows = {(r["Type"], r["Name"]): r for r in csv.DictReader(f)}
    for kind in ("TTFT", "ITL", "TPOT", "E2E"):
        row = rows.get((kind, "chat"))
        assert row is not None, f"no {kind} row in {sorted(rows)}"
        assert int(row["Request Count"]) > 0 and int(row["Failure Count"]) == 0, row
    e2e, itl = rows[("E2E", "chat")], rows[("ITL", "chat")]
    assert int(itl["Request Count"]) >= 7 * int(e2e["Request Count"])  # 8 tokens → 7 gaps per request
    assert (tmp_path / "report.html").stat().st_size > 0
