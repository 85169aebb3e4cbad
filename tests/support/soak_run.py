"""A background ``python -m loadtests.soak`` on the tiny model, as ``make soak`` runs it, and its cleanup.

Owns: `start_soak` (a copy of ``deploy/local.yaml`` serving the tiny model, one minute at 2
requests/s with short outputs, in a session of its own) and `SoakRun` (waiting for it; `SoakRun.stop`
ends it and everything it started). The reliability package's conftest starts it as the package
starts, so that its minute overlaps the other tests; ``tests/reliability/test_soak.py`` judges it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import yaml

REPO = Path(__file__).resolve().parents[2]


@dataclass
class SoakRun:
    """A running ``python -m loadtests.soak`` and what it will leave behind."""

    proc: subprocess.Popen[bytes]
    out: Path
    log: Path
    started: float = field(default_factory=time.monotonic)
    before: set[int] = field(default_factory=set)  # pids that existed before it started

    def wait(self, timeout_s: float) -> int:
        try:
            return self.proc.wait(timeout=max(1.0, timeout_s - (time.monotonic() - self.started)))
        finally:
            self.stop()

    def stop(self) -> None:
        """SIGTERM (the soak stops its server), then SIGKILL to everything it started."""
        if self.proc.poll() is None:
            descendants = psutil.Process(self.proc.pid).children(recursive=True)
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                for p in [*descendants, psutil.Process(self.proc.pid)]:
                    try:
                        p.kill()
                    except psutil.Error:
                        pass
                self.proc.wait(timeout=30)


def start_soak(tiny_model: str, workdir: Path) -> SoakRun:
    doc = yaml.safe_load((REPO / "deploy" / "local.yaml").read_text())
    doc["applications"][0]["args"].update(model=tiny_model, served_model_name="tiny")
    config = workdir / "soak-tiny.yaml"
    config.write_text(yaml.safe_dump(doc))
    out, log = workdir / "soak.json", workdir / "soak.log"
    before = {p.pid for p in psutil.process_iter()}
    cmd = [sys.executable, "-m", "loadtests.soak", "--config", str(config), "--minutes", "1", "--users", "2",
           "--rate", "2", "--max-tokens", "16", "--out", str(out)]
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "RAY_AUTH_MODE": "disabled"}, stdout=fh,
                                stderr=subprocess.STDOUT, start_new_session=True)
    return SoakRun(proc, out, log, before=before)
