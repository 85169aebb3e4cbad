"""`cluster.autoscaling`: ``autoscaling.policy: objectives`` from the YAML to Serve's deployment options
(built by `compose_app`, no cluster), the signals a replica reports from its own load report, and each
refusal naming its key."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from cluster import autoscaling
from cluster.app import compose_app
from cluster.autoscaling import KV_USE, POLICY_FUNCTION, QUEUE_WAIT, scaling_signals, with_scaling_signals
from cluster.config import ClusterConfig, ConfigError, Environment
from engine.load_report import LoadReport
from router.load_estimates import prefill_wait_s
from tests.support.pd_fakes import FakeDecode, FakePrefill, fake_codec

pytestmark = pytest.mark.timeout(60)

OBJECTIVES: dict[str, Any] = {
    "prefill": {"autoscaling": {"max_replicas": 3, "policy": "objectives", "queue_wait_up_s": 2.0,
                                "queue_wait_down_s": 0.5, "upscale_delay_s": 5}},
    "decode": {"autoscaling": {"min_replicas": 2, "max_replicas": 6, "policy": "objectives", "kv_use_up": 0.9}},
}


def _cfg(args: dict[str, Any]) -> ClusterConfig:
    return ClusterConfig.from_args(args, Environment())


def _deployments(cfg: ClusterConfig) -> dict[str, Any]:
    router = compose_app(cfg, prefill_cls=FakePrefill, decode_cls=FakeDecode, codec_factory=fake_codec)
    return {b._bound_deployment.name: b._bound_deployment for b in router._bound_deployment.init_args[:2]
            if b is not None}


def test_the_policy_and_its_thresholds_reach_serves_deployment_options() -> None:
    deps = _deployments(_cfg(OBJECTIVES))
    prefill = deps["prefill"]._deployment_config.autoscaling_config
    assert (prefill.min_replicas, prefill.max_replicas, prefill.upscale_delay_s) == (1, 3, 5)
    assert prefill.policy.policy_function == POLICY_FUNCTION
    assert prefill.policy.policy_kwargs == {"metric": QUEUE_WAIT, "up": 2.0, "down": 0.5}
    decode = deps["decode"]._deployment_config.autoscaling_config
    assert (decode.min_replicas, decode.max_replicas) == (2, 6)
    assert decode.policy.policy_kwargs == {"metric": KV_USE, "up": 0.9, "down": 0.3}  # down: its default
    for dep in deps.values():  # the replicas report the signals the policy reads
        assert callable(getattr(dep.func_or_class, "record_autoscaling_stats", None)), dep.name


def test_without_the_policy_serve_keeps_its_own_and_replicas_report_nothing_more() -> None:
    deps = _deployments(_cfg({"prefill": {"autoscaling": {"max_replicas": 3, "target_ongoing_requests": 8}}}))
    auto = deps["prefill"]._deployment_config.autoscaling_config
    assert auto.policy.is_default_policy_function() and auto.target_ongoing_requests == 8
    for dep in deps.values():
        assert not hasattr(dep.func_or_class, "record_autoscaling_stats"), dep.name


def _report(role: str, **fields: Any) -> LoadReport:
    base: dict[str, Any] = dict(replica_id="r", role=role, num_waiting=0, num_running=0, outstanding_tokens=0,
                                kv_blocks_free=96, kv_blocks_total=128)
    return LoadReport(**(base | fields))


def test_a_prefill_replicas_queue_wait_is_its_tokens_at_its_measured_rate() -> None:
    report = _report("prefill", outstanding_tokens=3000, prefill_tokens=20000, prefill_seconds=8.0)
    signals = scaling_signals(report)
    assert signals[QUEUE_WAIT] == pytest.approx(prefill_wait_s([report], 20000 / 8.0))  # the router's estimate
    assert signals[KV_USE] == pytest.approx(0.25)
    assert scaling_signals(_report("prefill"))[QUEUE_WAIT] == 0.0  # nothing queued
    assert QUEUE_WAIT not in scaling_signals(_report("prefill", outstanding_tokens=10))  # no rate yet


def test_a_decode_replica_reports_its_kv_use_only() -> None:
    assert scaling_signals(_report("decode", outstanding_tokens=5000, kv_blocks_free=32)) == {KV_USE: 0.75}
    assert scaling_signals(_report("decode", kv_blocks_total=0, kv_blocks_free=0)) == {}


def test_the_replica_class_reports_the_signals_of_its_load() -> None:
    cfg = _cfg(OBJECTIVES)
    cls = with_scaling_signals(FakeDecode, cfg.decode.autoscaling)
    replica: Any = cls(object())
    stats = asyncio.run(replica.record_autoscaling_stats())
    assert stats == scaling_signals(asyncio.run(replica.load()))
    assert with_scaling_signals(FakeDecode, None) is FakeDecode


@pytest.mark.parametrize(("args", "needle"), [
    ({"prefill": {"autoscaling": {"max_replicas": 2, "queue_wait_up_s": 3}}},
     "queue_wait_up_s: read only with policy: objectives"),
    ({"decode": {"autoscaling": {"max_replicas": 2, "policy": "objectives", "target_ongoing_requests": 4}}},
     "target_ongoing_requests: policy: objectives scales on kv_use"),
    ({"decode": {"autoscaling": {"max_replicas": 2, "policy": "objectives", "kv_use_up": 0.5, "kv_use_down": 0.6}}},
     "kv_use_down must be below kv_use_up"),
    ({"decode": {"autoscaling": {"max_replicas": 2, "policy": "slo"}}}, "decode.autoscaling.policy"),
    ({"router": {"autoscaling": {"max_replicas": 2, "policy": "objectives"}}}, "router.autoscaling.policy"),
    ({"decode": {"autoscaling": {"max_replicas": 2, "queue_wait_up_s": 1}}}, "decode.autoscaling.queue_wait_up_s"),
])
def test_a_bad_autoscaling_key_is_a_config_error_naming_it(args: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError) as e:
        _cfg(args)
    assert needle in str(e.value), str(e.value)


def test_a_ray_without_custom_policies_refuses_the_policy_saying_what_it_lacks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert autoscaling.ray_lacks_custom_policies() is None  # the installed Ray has what it needs
    monkeypatch.setattr(autoscaling, "ray_lacks_custom_policies", lambda: "no AutoscalingConfig.policy")
    with pytest.raises(ConfigError) as e:
        _cfg({"prefill": {"autoscaling": {"max_replicas": 2, "policy": "objectives"}}})
    assert "prefill.autoscaling" in str(e.value) and "policy: objectives needs a Ray Serve" in str(e.value)
    assert "no AutoscalingConfig.policy" in str(e.value)
    _cfg({"prefill": {"autoscaling": {"max_replicas": 2}}})  # Serve's own policy needs nothing more
