"""Placement on a real multi-node Ray cluster: each pool lands on its node group, the KV crosses
from the prefill node to the decode node over gloo, and greedy HTTP outputs equal the reference."""

from __future__ import annotations

import random
import time
from typing import Any

import pytest

from engine.config import EngineConfig
from engine.engine import Engine
from engine.generate import generate
from engine.sampling.sampler import SamplingParams
from engine.tokenizer import Tokenizer
from tests.support.multinode import APP, Deployed, completion

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


def replicas_by_deployment() -> dict[str, list[dict[str, Any]]]:
    """Serve's own record of each RUNNING replica, with the node it runs on."""
    from ray.serve.context import _get_global_client

    client = _get_global_client()
    assert client is not None
    details = client.get_serve_details()
    deps = details["applications"][APP]["deployments"]
    return {name: [r for r in d["replicas"] if r["state"] == "RUNNING"] for name, d in deps.items()}


def nodes_by_id() -> dict[str, dict[str, Any]]:
    import ray

    return {n["NodeID"]: n for n in ray.nodes() if n["Alive"]}


def test_each_pool_runs_on_its_node_group(deployed: Deployed) -> None:
    nodes = nodes_by_id()
    reps = replicas_by_deployment()
    where = {name: {r["node_id"] for r in rs} for name, rs in reps.items()}
    assert all(where.values()), reps
    for nid in where["prefill"]:
        assert "prefill_node" in nodes[nid]["Resources"] and nodes[nid]["Labels"]["pdserve.io/pool"] == "prefill"
    for nid in where["decode"]:
        assert "decode_node" in nodes[nid]["Resources"]
    for nid in where["router"]:
        assert nodes[nid]["Labels"]["pdserve.io/pool"] == "head"
    assert where["prefill"].isdisjoint(where["decode"])
    ips = {name: {nodes[n]["NodeManagerAddress"] for n in ids} for name, ids in where.items()}
    assert ips["prefill"] == {"127.0.0.3"} and ips["decode"] == {"127.0.0.4"}, ips


def test_greedy_over_http_equals_reference_with_kv_over_gloo_between_nodes(deployed: Deployed) -> None:
    from ray import serve

    prefill = serve.get_deployment_handle("prefill", app_name=APP)
    decode = serve.get_deployment_handle("decode", app_name=APP)
    before = prefill.stats.remote().result()["source"]
    # the decode replica meets the prefill replica's KV source from its load report, before any request
    deadline = time.monotonic() + 30
    while (kv := decode.stats.remote().result())["kv_sources"]["paired"] < 1:
        assert time.monotonic() < deadline, kv
        time.sleep(0.2)
    unpaired = kv["kv_pulls_unpaired"]
    ref_engine = Engine.from_dir(deployed.model, EngineConfig(num_blocks=64))
    tok = Tokenizer.from_dir(deployed.model)
    rng = random.Random(11)
    for n_prompt, n_out, stream in ((5, 12, False), (40, 24, True), (70, 16, False)):
        prompt = [rng.randrange(3, 49152) for _ in range(n_prompt)]
        ref = generate(ref_engine, prompt, SamplingParams(max_tokens=n_out, ignore_eos=True)).token_ids
        got = completion(deployed.base_url, prompt, n_out, stream=stream)["choices"][0]
        assert got["logprobs"]["tokens"] == [tok.decode([t], skip_special_tokens=False) for t in ref]
        assert got["text"] == tok.decode(ref)
    after = prefill.stats.remote().result()["source"]
    kv = decode.stats.remote().result()
    assert kv["kv_sources"] == {"listed": 1, "paired": 1, "meeting": 0, "failing": 0}, kv
    assert kv["kv_pulls_unpaired"] == unpaired  # every pull found its pair up: none was met inside a request
    assert after["transfers"] - before["transfers"] == 3, (before, after)  # every request's KV was pulled
    assert after["bytes_sent"] > before["bytes_sent"] and after["failed"] == before["failed"]
    assert after["host"] == "127.0.0.1"  # kv.host: the control channel and gloo bind loopback here
