"""Security of a running cluster: API keys, public paths, body limits, the KV secret, listening sockets.

A real tiny-model app (1 prefill + 1 decode, KV over gloo on 127.0.0.1) with one API key in its
config and two more from ``PDSERVE_API_KEYS`` (read by `cluster.config.Environment`, as
``pdserve serve`` does), ``/health`` as the only public path and a 4 KiB body limit.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import os
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any
from unittest import mock

import httpx
import psutil
import pytest
from ray import serve
from starlette.requests import Request

from cluster.app import compose_app
from cluster.config import ClusterConfig
from engine.model.config import ModelConfig
from kv_transfer.client import KVPuller, PullerConfig
from kv_transfer.errors import AuthError
from kv_transfer.handle import KVHandle
from kv_transfer.layout import KVLayout
from router.app import Router
from router.config import RouterConfig
from router.errors import APIError
from tests.support.kv_caches import make_cache
from tests.support.serve_harness import cluster_args, deploy, listening_sockets

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

APP = "security"
CONFIG_KEY = "cfg-key-0123"
ENV_KEYS = ("env-key-aaaa", "env-key-bbbb")
MAX_BODY = 4096
WILDCARDS = {"0.0.0.0", "::"}


@pytest.fixture(scope="module")
def url(serve_base: str, tiny_model: str) -> Iterator[str]:
    args = cluster_args(tiny_model, router={"api_keys": [CONFIG_KEY], "public_paths": ["/health"]},
                        limits={"max_body_bytes": MAX_BODY})
    with mock.patch.dict(os.environ, {"PDSERVE_API_KEYS": " , ".join(ENV_KEYS)}):
        cfg = ClusterConfig.from_args(args)  # the environment is read here, once
    assert cfg.router.api_keys == [CONFIG_KEY, *ENV_KEYS]
    with deploy(compose_app(cfg), APP, serve_base, headers=auth(CONFIG_KEY)) as u:
        yield u


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def assert_error(r: httpx.Response, status: int, code: str | None = None) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    if code is not None:
        assert err["code"] == code


V1 = [("GET", "/v1/models", None),
      ("POST", "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 3}),
      ("POST", "/v1/chat/completions", {"model": "tiny", "max_tokens": 3,
                                        "messages": [{"role": "user", "content": "hi"}]})]


@pytest.mark.parametrize(("method", "path", "body"), V1, ids=[p for _, p, _ in V1])
def test_every_v1_route_needs_one_of_the_keys(url: str, method: str, path: str, body: Any) -> None:
    with httpx.Client(timeout=60) as http:
        for headers in ({}, auth("wrong"), {"Authorization": CONFIG_KEY}, auth(CONFIG_KEY + "x"),
                        {"Authorization": f"Basic {CONFIG_KEY}"}, auth(CONFIG_KEY[:-1])):
            r = http.request(method, f"{url}{path}", json=body, headers=headers)
            assert_error(r, 401, "invalid_api_key")
        for key in (CONFIG_KEY, *ENV_KEYS):
            r = http.request(method, f"{url}{path}", json=body, headers=auth(key))
            assert r.status_code == 200, r.text


def test_public_paths_are_what_the_config_says(url: str) -> None:
    with httpx.Client(timeout=30) as http:
        assert http.get(f"{url}/health").status_code == 200
        for path in ("/metrics", "/ready"):
            assert_error(http.get(f"{url}{path}"), 401, "invalid_api_key")
            assert http.get(f"{url}{path}", headers=auth(ENV_KEYS[1])).status_code == 200
    assert RouterConfig().public_paths == ("/health", "/ready", "/metrics")  # the default: probes and scrapes
    assert "api_keys" not in repr(RouterConfig(api_keys=("secret-key",)))  # keys never print
    assert CONFIG_KEY not in json.dumps(ClusterConfig.from_args({"router": {"api_keys": [CONFIG_KEY]}}).redacted())


def test_key_comparison_takes_the_same_path_whatever_the_key() -> None:
    """Every configured key is compared with hmac.compare_digest, with no early exit on a match."""
    keys = ("k-one-111", "k-two-222", "k-three-333")
    # the real method on a stand-in for the replica's state (the Serve class is built for Serve to start)
    state = SimpleNamespace(_keys=tuple(k.encode() for k in keys), _config=RouterConfig(api_keys=keys))
    authorize = Router.func_or_class._authorize  # type: ignore[attr-defined]
    real = hmac.compare_digest
    for token in ("k-one-111", "k-three-333", "nope", "", "k-one-11"):
        with mock.patch("router.app.hmac.compare_digest", side_effect=real) as spy:
            request = Request({"type": "http", "path": "/v1/models", "root_path": "",
                               "headers": [(b"authorization", f"Bearer {token}".encode())]})
            try:
                authorize(state, request)
                ok = True
            except APIError:
                ok = False
        assert ok == (token in keys)
        assert spy.call_count == len(keys), (token, spy.call_count)


def test_request_bodies_over_the_limit_are_413(url: str) -> None:
    big = json.dumps({"model": "tiny", "prompt": "a" * (2 * MAX_BODY)}).encode()

    def chunked() -> Iterator[bytes]:  # no Content-Length: the limit is enforced as the body streams in
        for i in range(0, len(big), 512):
            yield big[i:i + 512]

    with httpx.Client(timeout=30) as http:
        headers = {**auth(CONFIG_KEY), "Content-Type": "application/json"}
        assert_error(http.post(f"{url}/v1/completions", content=big, headers=headers), 413, "request_too_large")
        r = http.post(f"{url}/v1/completions", content=chunked(), headers=headers)
        assert "content-length" not in {k.lower() for k in r.request.headers}
        assert_error(r, 413, "request_too_large")
        small = json.dumps({"model": "tiny", "prompt": "a" * (MAX_BODY - 200), "max_tokens": 1}).encode()
        assert http.post(f"{url}/v1/completions", content=small, headers=headers).status_code != 413


def _prefill_stats() -> dict[str, Any]:
    return dict(serve.get_deployment_handle("prefill", app_name=APP).stats.remote().result(timeout_s=30))


def test_the_kv_control_channel_refuses_a_peer_without_the_secret(url: str, tiny_model: str) -> None:
    before = _prefill_stats()
    host, port = before["source"]["host"], before["source"]["port"]
    layout = KVLayout.from_model(ModelConfig.from_dir(tiny_model), "float32", 16)
    handle = KVHandle("stolen-ticket", host, port, 16, layout, 2e9)

    async def pull(secret: bytes) -> None:
        puller = KVPuller(secret, layout, PullerConfig(host="127.0.0.1"))
        try:
            await puller.pull(handle, make_cache(layout, 4), [0], timeout_s=10)
        finally:
            await puller.close()

    with pytest.raises(AuthError):
        asyncio.run(pull(b"not-the-cluster-secret-0123456789"))
    after = _prefill_stats()
    assert after["source"]["auth_failures"] == before["source"]["auth_failures"] + 1
    assert after["outbox_pending"] == 0  # nothing was handed out


def _our_processes() -> dict[str, int]:
    """pid of each Ray process of this cluster that serves our code: the app's replicas and the proxy."""
    out: dict[str, int] = {}
    for p in psutil.Process().children(recursive=True):
        try:
            title = " ".join(p.cmdline())
        except psutil.Error:
            continue
        if title.startswith(f"ray::ServeReplica:{APP}:") or title.startswith("ray::ProxyActor"):
            out[title.split()[0].split(".")[0].removeprefix("ray::")] = p.pid
    return out


@serve.deployment(ray_actor_options={"num_cpus": 0.01})
class _Bare:
    """A do-nothing Serve replica: what Ray and Serve listen on in a replica before any of our code runs."""

    def pid(self) -> int:
        return os.getpid()


def test_nothing_of_ours_listens_on_all_interfaces(url: str, serve_base: str) -> None:
    """Every socket our code opens (HTTP, KV control channel, gloo stores and devices) is on 127.0.0.1.

    Ray's and Serve's own gRPC servers bind all interfaces in every replica process, ours or not
    (Ray 2.60 has no setting for it); they are counted on a bare replica and discounted.
    """
    handle = serve.run(_Bare.bind(), name="security-bare", route_prefix="/security-bare")  # type: ignore[attr-defined]
    try:
        ray_own = [a for a, _ in listening_sockets(handle.pid.remote().result(timeout_s=60)) if a in WILDCARDS]
    finally:
        serve.delete("security-bare")
    httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "open a gloo pair", "max_tokens": 4},
               headers=auth(CONFIG_KEY), timeout=60).raise_for_status()
    procs = _our_processes()
    assert {"ServeReplica:security:prefill", "ServeReplica:security:decode", "ServeReplica:security:router",
            "ProxyActor"} <= set(procs), procs
    report = {}
    for name, pid in procs.items():
        socks = listening_sockets(pid)
        wild = [s for s in socks if s[0] in WILDCARDS]
        ours = [s for s in socks if s[0] not in WILDCARDS]
        report[name] = socks
        assert len(wild) <= len(ray_own), (name, socks, ray_own)  # the proxy, a plain actor, has fewer
        assert all(addr == "127.0.0.1" for addr, _ in ours), (name, socks)
    kv = _prefill_stats()["source"]
    assert (kv["host"], kv["port"]) in report["ServeReplica:security:prefill"]
    http_port = int(httpx.URL(serve_base).port or 0)
    assert ("127.0.0.1", http_port) in report["ProxyActor"]
    print(f"listening sockets (Ray's own per worker: {len(ray_own)} on {sorted(set(ray_own))}): {report}")
