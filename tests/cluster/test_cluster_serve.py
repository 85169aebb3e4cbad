"""The shipped YAMLs, wired by `compose_app`, on a real local Ray Serve with fake replica classes.

What this checks beyond the router tests: the configs the YAMLs produce reach the replicas, the
deployments are named and sized as configured, the custom request router is on both pools, and
`cluster.local`'s readiness wait and curl example work against a live app.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import ray
from ray import cloudpickle, serve

from cluster.app import compose_app
from cluster.config import ClusterConfig, Environment
from cluster.local import curl_example, wait_ready
from loadtests.bench_common import free_port
from tests.support import pd_fakes
from tests.support.pd_fakes import FakeDecode, FakePrefill, expected_text, fake_codec

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
MODEL = "smollm2-135m-instruct"


class RecordingPrefill(FakePrefill):
    """Also answers with the worker config it was built with."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self._config = config

    async def config(self) -> dict[str, Any]:
        return dataclasses.asdict(self._config)


class RecordingDecode(FakeDecode):
    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self._config = config

    async def config(self) -> dict[str, Any]:
        return dataclasses.asdict(self._config)


@pytest.fixture(scope="module")
def base() -> Iterator[str]:
    os.environ["RAY_AUTH_MODE"] = "disabled"
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    cloudpickle.register_pickle_by_value(pd_fakes)
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        env = Environment(api_keys=("env-key",), kv_secret="shared-secret")
        disagg = ClusterConfig.from_yaml(DEPLOY / "local.yaml", env)
        serve.run(compose_app(disagg, prefill_cls=RecordingPrefill, decode_cls=RecordingDecode,
                              codec_factory=fake_codec), name="pd", route_prefix="/pd")
        colo = ClusterConfig.from_yaml(DEPLOY / "local-colocated.yaml", Environment())
        serve.run(compose_app(colo, decode_cls=RecordingDecode, codec_factory=fake_codec),
                  name="colo", route_prefix="/colo")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def test_local_yaml_app_serves_and_needs_the_env_key(base: str) -> None:
    wait_ready(f"{base}/pd", timeout_s=30)
    ok = openai.OpenAI(base_url=f"{base}/pd/v1", api_key="env-key", max_retries=0, timeout=30)
    msgs: Any = [{"role": "user", "content": "hello"}]
    r = ok.chat.completions.create(model=MODEL, messages=msgs, max_tokens=5)
    assert r.choices[0].message.content == expected_text("<user>hello<assistant>", 5)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{base}/pd/v1", api_key="nope", max_retries=0).models.list()


def test_replicas_got_the_yaml_configs(base: str) -> None:
    status = serve.status().applications["pd"].deployments
    assert set(status) == {"router", "prefill", "decode"}
    prefill = serve.get_deployment_handle("prefill", app_name="pd").config.remote().result()
    decode = serve.get_deployment_handle("decode", app_name="pd").config.remote().result()
    assert prefill["kv"]["transport"] == "gloo" and prefill["kv"]["secret"] == "shared-secret"
    assert decode["kv"]["secret"] == "shared-secret" and decode["mode"] == "disaggregated"
    assert prefill["engine"]["num_blocks"] == 256 and decode["engine"]["num_blocks"] == 512
    assert prefill["engine"]["max_model_len"] == 4096 and prefill["max_batch_tokens"] == 2048
    colo = serve.get_deployment_handle("decode", app_name="colo").config.remote().result()
    assert colo["mode"] == "colocated" and colo["prefill_chunk_size"] == 512
    assert set(serve.status().applications["colo"].deployments) == {"router", "decode"}


def test_colocated_yaml_app_streams(base: str) -> None:
    c = openai.OpenAI(base_url=f"{base}/colo/v1", api_key="unused", max_retries=0, timeout=30)
    chunks = list(c.completions.create(model=MODEL, prompt="abc", max_tokens=6, stream=True,
                                       stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == "defghi"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6


def test_pool_gauges_come_from_the_custom_request_router(base: str) -> None:
    import time

    deadline = time.time() + 15
    text = ""
    while time.time() < deadline:
        text = httpx.get(f"{base}/pd/metrics", timeout=30).text
        if text.count("pdserve:kv_blocks_free{") == 2:
            break
        time.sleep(0.5)
    assert 'role="prefill"' in text and 'role="decode"' in text, text


def test_printed_curl_works(base: str) -> None:
    cmd = curl_example(f"{base}/pd", MODEL, "env-key")
    out = subprocess.run(shlex.split(cmd), capture_output=True, text=True, timeout=60, check=True).stdout
    events = [ln[6:] for ln in out.splitlines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[0])["object"] == "chat.completion.chunk"
