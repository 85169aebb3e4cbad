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
from pathlib import Path

import pytest

from loadtests.bench_common import free_port
from tests.support.models import make_tiny_chat_model
from tests.support.multinode import Deployed, app_args
from tests.support.ray_nodes import LocalRayCluster


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
