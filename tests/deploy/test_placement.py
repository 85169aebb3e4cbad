"""`cluster.placement` without a cluster: YAML fields → Serve options, validation, the capacity check."""

from __future__ import annotations

from typing import Any

import pytest

from cluster.app import compose_app
from cluster.config import ClusterConfig, ConfigError, Environment
from cluster.placement import Demand, NodeGroup, pack, parse_selector, selector_matches
from tests.support.pd_fakes import FakeDecode, FakePrefill, fake_codec

pytestmark = pytest.mark.timeout(60)

ARGS: dict[str, Any] = {
    "prefill": {"num_cpus": 1,
                "placement": {"resources": {"prefill_node": 0.01}, "label_selector": {"pdserve.io/pool": "prefill"}},
                "autoscaling": {"min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 8,
                                "upscale_delay_s": 5}},
    "decode": {"num_replicas": 2, "num_cpus": 1,
               "placement": {"resources": {"decode_node": 0.01}, "max_replicas_per_node": 1},
               "drain": {"wait_loop_s": 0.2, "timeout_s": 90}},
    "router": {"num_replicas": 2, "placement": {"label_selector": {"pdserve.io/pool": "!in(prefill,decode)"}}},
}


def _cfg(args: dict[str, Any]) -> ClusterConfig:
    return ClusterConfig.from_args(args, Environment())


def _deployments(cfg: ClusterConfig) -> dict[str, Any]:
    router = compose_app(cfg, prefill_cls=FakePrefill, decode_cls=FakeDecode, codec_factory=fake_codec)
    deps = {"router": router._bound_deployment}
    for bound in router._bound_deployment.init_args[:2]:
        if bound is not None:
            deps[bound._bound_deployment.name] = bound._bound_deployment
    return deps


def test_placement_reaches_the_deployments_options() -> None:
    deps = _deployments(_cfg(ARGS))
    prefill, decode, router = deps["prefill"], deps["decode"], deps["router"]
    assert prefill.ray_actor_options["resources"] == {"prefill_node": 0.01}
    assert prefill.ray_actor_options["label_selector"] == {"pdserve.io/pool": "prefill"}
    auto = prefill._deployment_config.autoscaling_config
    assert (auto.min_replicas, auto.max_replicas, auto.target_ongoing_requests, auto.upscale_delay_s) == (1, 3, 8, 5)
    assert decode.ray_actor_options["resources"] == {"decode_node": 0.01}
    assert decode._deployment_config.num_replicas == 2 and decode._deployment_config.autoscaling_config is None
    assert decode._replica_config.max_replicas_per_node == 1
    assert decode._deployment_config.graceful_shutdown_timeout_s == 90
    assert decode._deployment_config.graceful_shutdown_wait_loop_s == 0.2
    assert router.ray_actor_options["label_selector"] == {"pdserve.io/pool": "!in(prefill,decode)"}
    assert router._deployment_config.num_replicas == 2
    # defaults: no pinning, Serve's drain set from our defaults
    plain = _deployments(_cfg({}))
    assert "resources" not in plain["decode"].ray_actor_options
    assert plain["decode"]._deployment_config.graceful_shutdown_timeout_s == 60


@pytest.mark.parametrize(("args", "needle"), [
    ({"decode": {"num_replicas": 2, "autoscaling": {"max_replicas": 4}}}, "- decode: set num_replicas or autoscaling"),
    ({"decode": {"autoscaling": {"min_replicas": 3, "max_replicas": 2}}}, "min_replicas <= initial_replicas"),
    ({"decode": {"autoscaling": {"min_replicas": 0, "max_replicas": 2}}}, "decode.autoscaling.min_replicas"),
    ({"prefill": {"placement": {"resources": {"GPU": 1}}}}, "prefill.placement.resources: 'GPU' is not a custom"),
    ({"prefill": {"placement": {"resources": {"prefill_node": 1.5}}}}, "a fraction in (0, 1] or a whole number"),
    ({"router": {"placement": {"label_selector": {"bad key!": "x"}}}}, "not a valid label key"),
    ({"router": {"placement": {"label_selector": {"pool": "in(a,"}}}}, "expected 'value', '!value'"),
    ({"decode": {"placement": {"resource": {}}}}, "decode.placement.resource: unknown key (allowed: resources,"),
    ({"decode": {"drain": {"timeout": 5}}}, "decode.drain.timeout: unknown key"),
])
def test_bad_placement_is_a_config_error(args: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError) as e:
        _cfg(args)
    assert needle in str(e.value), str(e.value)


def test_selector_forms() -> None:
    assert parse_selector("a") == (False, frozenset({"a"}))
    assert parse_selector("!in(a, b)") == (True, frozenset({"a", "b"}))
    assert selector_matches({"pool": "in(prefill,decode)"}, {"pool": "decode"})
    assert not selector_matches({"pool": "!decode"}, {"pool": "decode"})
    assert selector_matches({"pool": "!decode"}, {})
    assert not selector_matches({"pool": "prefill"}, {})


def test_pack_places_each_pool_on_its_group_and_names_what_does_not_fit() -> None:
    groups = [NodeGroup("head", 1, {"CPU": 4}, {"pdserve.io/pool": "head"}),
              NodeGroup("prefill-gpu", 2, {"CPU": 8, "GPU": 1, "prefill_node": 1}, {"pdserve.io/pool": "prefill"}),
              NodeGroup("decode-gpu", 2, {"CPU": 8, "GPU": 1, "decode_node": 1}, {"pdserve.io/pool": "decode"})]
    fit = pack([Demand("router", 2, {"CPU": 1}, {"pdserve.io/pool": "head"}),
                Demand("prefill", 2, {"CPU": 4, "GPU": 1, "prefill_node": 0.01}),
                Demand("decode", 2, {"CPU": 4, "GPU": 1, "decode_node": 0.01})], groups)
    assert fit.ok, fit.problems
    assert fit.placed == {"router": {"head": 2}, "prefill": {"prefill-gpu": 2}, "decode": {"decode-gpu": 2}}

    short = pack([Demand("decode", 3, {"CPU": 4, "GPU": 1, "decode_node": 0.01})], groups)
    assert short.problems == ["decode: only 2 of 3 replicas fit (each needs {CPU: 4, GPU: 1, decode_node: 0.01}; "
                              "groups that can host it: decode-gpu)"]
    nowhere = pack([Demand("decode", 1, {"CPU": 1, "GPU": 2})], groups)
    assert nowhere.problems == ["decode: no node group offers {CPU: 1, GPU: 2}"]
    spread = pack([Demand("decode", 2, {"CPU": 1, "decode_node": 0.01}, max_per_node=1)], groups[2:3])
    assert spread.ok and spread.placed == {"decode": {"decode-gpu": 2}}
