"""One multi-node Ray cluster for the deploy tests, shared by the package (started once, ~40 s).

Layout: ``head`` (router, Serve controller and HTTP proxy; label pool=head), ``prefill`` (custom
resource ``prefill_node``; label pool=prefill) and ``decode`` (``decode_node``; pool=decode), each
its own ``ray start`` on its own loopback address. The app is the real one (`build_app`'s
`compose_app` with the real replica classes) over a tiny random Llama that speaks SmolLM2's
tokenizer, KV over gloo between the prefill and decode nodes.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from cluster.config import ClusterConfig, Environment
from tests.deploy.ray_nodes import LocalRayCluster, free_port
from tests.support.models import make_tiny_chat_model

APP = "pd"
KV_SECRET = "deploy-tests-kv-secret"  # fixed: a redeploy's new replicas must talk to the old ones


def app_args(model: Path, **decode: Any) -> dict[str, Any]:
    """The tests' cluster config: every pool pinned to its node group."""
    return {
        "model": str(model), "served_model_name": "tiny", "mode": "disaggregated",
        "engine": {"device": "cpu", "dtype": "float32", "block_size": 16, "num_threads": 1},
        "prefill": {"num_cpus": 0.3, "num_blocks": 256, "max_batch_tokens": 1024,
                    "placement": {"resources": {"prefill_node": 0.01},
                                  "label_selector": {"pdserve.io/pool": "prefill"}},
                    "drain": {"wait_loop_s": 0.2, "timeout_s": 20}},
        "decode": {"num_cpus": 0.3, "num_blocks": 512,
                   "placement": {"resources": {"decode_node": 0.01}},
                   "drain": {"wait_loop_s": 0.2, "timeout_s": 60}, **decode},
        "router": {"num_cpus": 0.1, "placement": {"label_selector": {"pdserve.io/pool": "head"}},
                   "drain": {"wait_loop_s": 0.2, "timeout_s": 60}},
        "kv": {"transport": "gloo", "host": "127.0.0.1", "timeout_s": 30},
        "limits": {"max_model_len": 4096, "token_timeout_s": 30},
    }


@dataclass
class Deployed:
    cluster: LocalRayCluster
    base_url: str
    http_port: int
    model: Path

    def deploy(self, args: dict[str, Any]) -> None:
        from ray import serve

        from cluster.app import compose_app

        cfg = ClusterConfig.from_args(args, Environment(kv_secret=KV_SECRET))
        serve.run(compose_app(cfg), name=APP, route_prefix="/", blocking=False)
        wait_running()


def wait_running(timeout_s: float = 120.0) -> None:
    import time

    from ray import serve

    deadline = time.monotonic() + timeout_s
    status = None
    while time.monotonic() < deadline:
        status = serve.status().applications.get(APP)
        if status is not None and status.status == "RUNNING":
            return
        if status is not None and status.status == "DEPLOY_FAILED":
            raise RuntimeError(f"deploy failed: {status.message}")
        time.sleep(0.25)
    raise TimeoutError(f"app {APP} not RUNNING within {timeout_s:g} s: {status}")


@pytest.fixture(scope="package")
def deployed() -> Iterator[Deployed]:
    import ray
    from ray import serve

    from cluster.local import wait_ready

    root = Path(tempfile.mkdtemp(prefix="pdd", dir="/tmp"))  # short: Ray's socket paths live under it
    cluster = LocalRayCluster(root)
    try:
        model = make_tiny_chat_model(root / "tiny", seed=7)
        cluster.start_head(1, labels={"pdserve.io/pool": "head"})
        cluster.connect()
        cluster.add_node("prefill", 1, {"prefill_node": 1}, {"pdserve.io/pool": "prefill"})
        cluster.add_node("decode", 1, {"decode_node": 1}, {"pdserve.io/pool": "decode"})
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port, "location": "HeadOnly"})
        d = Deployed(cluster, f"http://127.0.0.1:{port}", port, model)
        d.deploy(app_args(model))
        wait_ready(d.base_url, timeout_s=60)
        yield d
    finally:
        try:
            if ray.is_initialized():
                serve.shutdown()
        finally:
            ray.shutdown()
            cluster.stop()
            shutil.rmtree(root, ignore_errors=True)
