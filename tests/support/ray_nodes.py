"""Several Ray nodes on one host for the deploy tests: one ``ray start --block`` process per node.

Owns: `LocalRayCluster`, which starts a head and worker nodes (each with its own CPUs, custom
resources, labels and loopback address — 127.0.0.2, .3, ... — free ports, one private temp dir), and
stops every
process it started — each node runs in a session of its own, and `stop` ends exactly the
processes of those sessions, by pid (SIGTERM, then SIGKILL).

Why ``ray start`` and not ``ray.cluster_utils.Cluster``: `Cluster` writes (and on shutdown deletes)
the machine-wide ``/tmp/ray/ray_current_cluster``, which a plain ``ray.init()`` elsewhere on a shared
host would pick up; ``ray start --temp-dir`` keeps it inside our temp dir. It is also the
multi-node recipe of docs/deployment.md. Why not 127.0.0.1: Ray rewrites "127.0.0.1" and "localhost"
to the host's outward address (``resolve_ip_for_localhost``); other loopback addresses it keeps, and
each node having its own makes the nodes distinct hosts to Ray while staying on ``lo``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from loadtests.bench_common import free_port

REPO = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).with_name("ray"))


def node_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0", OMP_NUM_THREADS="1",
               MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p))
    env.pop("RAY_ADDRESS", None)
    return env


@dataclass
class RayNode:
    name: str
    proc: subprocess.Popen[bytes]
    ip: str
    resources: dict[str, float] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)


class LocalRayCluster:
    """Head + worker nodes as ``ray start --block`` processes (see the module docstring)."""

    def __init__(self, temp_dir: Path) -> None:
        self.temp_dir = temp_dir  # short: Ray's unix socket paths live under it
        self.port = free_port()
        self.head_ip = "127.0.0.2"
        self.address = f"{self.head_ip}:{self.port}"
        self.nodes: list[RayNode] = []

    def _start(self, name: str, args: list[str], num_cpus: float, resources: dict[str, float],
               labels: dict[str, str]) -> RayNode:
        ip = f"127.0.0.{len(self.nodes) + 2}"
        cmd = [RAY, "start", "--block", "--disable-usage-stats", f"--temp-dir={self.temp_dir}",
               f"--node-ip-address={ip}", f"--num-cpus={num_cpus:g}", "--num-gpus=0",
               "--object-store-memory=100000000", f"--dashboard-agent-listen-port={free_port()}",
               f"--resources={json.dumps(resources)}", *args]
        if labels:
            cmd.append("--labels=" + ",".join(f"{k}={v}" for k, v in labels.items()))
        log = open(self.temp_dir / f"{name}.log", "wb")  # noqa: SIM115 - the child owns it from here on
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=node_env(), cwd=REPO,
                                start_new_session=True)
        log.close()
        node = RayNode(name, proc, ip, resources, labels)
        self.nodes.append(node)
        return node

    def start_head(self, num_cpus: float, resources: dict[str, float] | None = None,
                   labels: dict[str, str] | None = None, timeout_s: float = 60.0) -> RayNode:
        # Even without the dashboard Ray starts a minimal one (usage stats) on --dashboard-port,
        # 8265 by default and without retries: another cluster on this host may hold that port.
        node = self._start("head", ["--head", f"--port={self.port}", "--include-dashboard=false",
                                    f"--dashboard-port={free_port()}", f"--ray-client-server-port={free_port()}"],
                           num_cpus, resources or {}, labels or {})
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if node.proc.poll() is not None:
                raise RuntimeError(f"ray head exited ({node.proc.returncode}): {self.log('head')}")
            with socket.socket() as s:
                if s.connect_ex((self.head_ip, self.port)) == 0:
                    return node
            time.sleep(0.2)
        raise TimeoutError(f"ray head did not listen on {self.address} within {timeout_s:g} s")

    def connect(self) -> None:
        """``ray.init`` this process as a driver on the head node (after `start_head`)."""
        import ray

        ray.init(address=self.address, _node_ip_address=self.head_ip, log_to_driver=False)

    def add_node(self, name: str, num_cpus: float, resources: dict[str, float] | None = None,
                 labels: dict[str, str] | None = None, timeout_s: float = 90.0) -> RayNode:
        """Start a worker node and wait until it is alive (after `connect`). One at a time: nodes
        sharing a session directory pick their log file names racily when started together."""
        node = self._start(name, [f"--address={self.address}"], num_cpus, resources or {}, labels or {})
        self._wait_alive(timeout_s)
        return node

    def _wait_alive(self, timeout_s: float) -> None:
        import ray

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for n in self.nodes:
                if n.proc.poll() is not None:
                    raise RuntimeError(f"ray node {n.name} exited ({n.proc.returncode}): {self.log(n.name)}")
            if sum(1 for n in ray.nodes() if n["Alive"]) >= len(self.nodes):
                return
            time.sleep(0.3)
        raise TimeoutError(f"{len(self.nodes)} Ray nodes not alive within {timeout_s:g} s")

    def log(self, name: str) -> str:
        path = self.temp_dir / f"{name}.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""

    def stop(self, grace_s: float = 4.0) -> None:
        """End every process of every node's session (workers, raylet, GCS, agents), by pid."""
        sessions = {n.proc.pid for n in self.nodes}
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            procs = _in_sessions(sessions)
            for p in procs:
                try:
                    p.send_signal(sig)
                except psutil.Error:
                    pass
            psutil.wait_procs(procs, timeout=wait_s)
        for n in self.nodes:
            try:
                n.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        left = _in_sessions(sessions)
        if left:
            raise RuntimeError(f"Ray processes survived the stop: {[p.pid for p in left]}")


def _in_sessions(sessions: set[int]) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) in sessions:
                out.append(p)
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    return out
