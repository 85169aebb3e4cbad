"""The deploy tests' app on a multi-node local Ray cluster: its config, (re)deploys, one completion call.

Owns: `app_args` (the tests' cluster config, every pool pinned to its node group), `Deployed` (the
running cluster and app; `Deployed.deploy` redeploys with new args under the same fixed KV secret, so
a redeploy's new replicas can talk to the old ones), `wait_running` and `completion` (one greedy
``/v1/completions`` call, streamed or not, returning the text and tokens). The cluster itself is
`tests.support.ray_nodes.LocalRayCluster`; the package fixture that starts it is in
``tests/deploy/conftest.py``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from cluster.config import ClusterConfig, Environment
from tests.support.ray_nodes import LocalRayCluster

APP = "pd"
KV_SECRET = "deploy-tests-kv-secret"  # fixed: a redeploy's new replicas must talk to the old ones


def app_args(model: Path, **decode: Any) -> dict[str, Any]:
    """The tests' cluster config: every pool pinned to its node group, every prompt prefilled in the
    prefill pool (``router.prefill_path: remote``: the tests follow the KV from node to node)."""
    return {
        "model": str(model), "served_model_name": "tiny", "mode": "disaggregated",
        "engine": {"device": "cpu", "dtype": "float32", "block_size": 16, "num_threads": 1, "decode_attention": "sdpa"},
        "prefill": {"num_cpus": 0.3, "num_blocks": 256, "max_batch_tokens": 1024,
                    "placement": {"resources": {"prefill_node": 0.01},
                                  "label_selector": {"pdserve.io/pool": "prefill"}},
                    "drain": {"wait_loop_s": 0.2, "timeout_s": 20}},
        "decode": {"num_cpus": 0.3, "num_blocks": 512,
                   "placement": {"resources": {"decode_node": 0.01}},
                   "drain": {"wait_loop_s": 0.2, "timeout_s": 60}, **decode},
        "router": {"num_cpus": 0.1, "placement": {"label_selector": {"pdserve.io/pool": "head"}},
                   "drain": {"wait_loop_s": 0.2, "timeout_s": 60}, "prefill_path": "remote"},
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


def completion(base: str, prompt: list[int], max_tokens: int, stream: bool = False) -> dict[str, Any]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "logprobs": 1, "stream": stream}
    if not stream:
        r = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return dict(r.json())
    tokens: list[str] = []
    text: list[str] = []
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                (choice,) = chunk["choices"]
                text.append(choice["text"])
                tokens += choice["logprobs"]["tokens"]
    return {"choices": [{"text": "".join(text), "logprobs": {"tokens": tokens}}]}
