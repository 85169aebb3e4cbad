"""``autoscaling.policy: objectives`` on a real local Ray Serve: `compose_app` with fake replicas whose
load reports a prefill queue far past its threshold; Serve's controller must call the replicas'
``record_autoscaling_stats``, run `cluster.scaling_policy.ThresholdPolicy` as handed to it, and start
the second prefill replica, while the decode pool (its KV use inside its band) stays as it is."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
import ray
from ray import cloudpickle, serve
from ray.serve._private.common import ReplicaState

from cluster.app import compose_app
from cluster.config import ClusterConfig, Environment
from engine.load_report import LoadReport
from loadtests.bench_common import free_port
from tests.support import pd_fakes
from tests.support.pd_fakes import FakeDecode, FakePrefill, fake_codec

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

ARGS: dict[str, Any] = {
    # 5,000 queued tokens at 1,000 tokens/s: a 5 s wait, past the 1 s threshold
    "prefill": {"autoscaling": {"min_replicas": 1, "max_replicas": 2, "policy": "objectives",
                                "queue_wait_up_s": 1.0, "upscale_delay_s": 0}},
    # FakeDecode's KV use (38 of 128 blocks): inside [0.1, 0.8], so it holds
    "decode": {"autoscaling": {"min_replicas": 1, "max_replicas": 2, "policy": "objectives",
                               "kv_use_up": 0.8, "kv_use_down": 0.1, "upscale_delay_s": 0, "downscale_delay_s": 0}},
}


class BusyPrefill(FakePrefill):
    async def load(self) -> LoadReport:
        report = await super().load()
        return LoadReport(**(vars(report) | {"outstanding_tokens": 5000, "prefill_tokens": 1000,
                                             "prefill_seconds": 1.0}))


@pytest.fixture(scope="module")
def app() -> Iterator[str]:
    os.environ["RAY_AUTH_MODE"] = "disabled"
    # replicas push their autoscaling stats every 0.5 s instead of 10 s (read by the replicas at start)
    os.environ["RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S"] = "0.5"
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    cloudpickle.register_pickle_by_value(pd_fakes)
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": free_port()})
        cfg = ClusterConfig.from_args(ARGS, Environment())
        serve.run(compose_app(cfg, prefill_cls=BusyPrefill, decode_cls=FakeDecode, codec_factory=fake_codec),
                  name="auto", route_prefix="/auto")
        yield "auto"
    finally:
        serve.shutdown()
        ray.shutdown()
        os.environ.pop("RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S", None)


def _running(app: str, deployment: str) -> int:
    states = serve.status().applications[app].deployments[deployment].replica_states
    return states.get(ReplicaState.RUNNING, 0)


def test_a_prefill_queue_past_its_threshold_adds_a_replica_and_decode_holds(app: str) -> None:
    deadline = time.monotonic() + 90
    while _running(app, "prefill") < 2 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _running(app, "prefill") == 2, serve.status().applications[app].deployments["prefill"]
    assert _running(app, "decode") == 1, serve.status().applications[app].deployments["decode"]
