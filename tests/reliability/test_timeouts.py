"""Every wait between components has a deadline, a configured default, and a documented error.

- the prefill call (``limits.prefill_timeout_s``): a replica that never answers → 503
  ``service_unavailable`` before any token, and the replica's call is cancelled;
- each decode token (``limits.token_timeout_s``): a stream that goes silent is cancelled and moves to
  a live replica (``limits.migration_limit`` times at most), then → an SSE error event naming the
  limit, then ``data: [DONE]``;
- the KV pull (``kv.timeout_s``): a prefill replica whose KV source accepts the connection and
  never speaks → the real decode replica fails the pull at the timeout and frees the blocks it
  reserved; the router prefills once more (a lost KV is rebuilt once) and, the second pull
  failing the same way, ends the stream with a "KV transfer failed" error event: within twice
  the timeout.

Misbehaving replicas come from `tests.support.stuck_pools`, injected through `compose_app` (the
first two run on the package's ``fakes`` app, see ``conftest.py``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import pytest
from ray import serve

from cluster.app import compose_app
from cluster.config import ClusterConfig
from kv_transfer.client import PullerConfig
from kv_transfer.server import SourceConfig
from router.config import RouterConfig
from tests.support.serve_harness import FAKES_PREFILL_TIMEOUT_S as PREFILL_TIMEOUT_S
from tests.support.serve_harness import FAKES_TOKEN_TIMEOUT_S as TOKEN_TIMEOUT_S
from tests.support.serve_harness import StreamResult, cluster_args, completion_body, deploy, stream_request
from tests.support.stuck_pools import SilentSourcePrefill

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

PULL = "pulltimeout"
PULL_TIMEOUT_S = 2.0


def test_configured_defaults_reach_every_component() -> None:
    """The defaults a YAML gets without saying anything, and where each one lands."""
    cfg = ClusterConfig.from_args({})
    router, decode, prefill = cfg.router_config(), cfg.decode_worker_config(), cfg.prefill_worker_config()
    assert (router.prefill_timeout_s, router.token_timeout_s, router.ready_timeout_s) == (120.0, 60.0, 5.0)
    assert decode.token_timeout_s == 60.0  # the decode replica's own bound on a silent stream
    assert decode.kv.timeout_s == prefill.kv.timeout_s == 30.0  # a pull, and the source's transfer
    assert prefill.kv.lease_s == 30.0  # an unpulled handle's blocks come back after this
    source, puller = SourceConfig(), PullerConfig()
    # no idle timeout: a pair lives until its peer dies
    assert (source.handshake_timeout_s, source.io_timeout_s, source.idle_timeout_s) == (10.0, 30.0, None)
    assert (puller.connect_timeout_s, puller.close_timeout_s) == (10.0, 10.0)
    custom = ClusterConfig.from_args({"limits": {"prefill_timeout_s": 2, "token_timeout_s": 3}, "kv": {"timeout_s": 4}})
    assert (custom.router_config().prefill_timeout_s, custom.router_config().token_timeout_s) == (2, 3)
    assert (custom.decode_worker_config().token_timeout_s, custom.decode_worker_config().kv.timeout_s) == (3, 4)


def ids(text: str) -> list[int]:
    """A prompt as token ids the fakes read back as ``text`` (they see prompts as code points)."""
    return [ord(c) for c in text]


def test_prefill_timeout_is_a_503_and_cancels_the_call(fakes_url: str) -> None:
    t0 = time.monotonic()
    r = httpx.post(f"{fakes_url}/v1/completions", json=completion_body(ids("HANG please"), 8), timeout=30)
    elapsed = time.monotonic() - t0
    err = r.json()["error"]
    print(f"prefill timeout: HTTP {r.status_code} after {elapsed:.2f} s (limit {PREFILL_TIMEOUT_S} s): "
          f"{err['message']}")
    assert r.status_code == 503 and err["code"] == "service_unavailable" and err["type"] == "service_unavailable"
    assert f"within {PREFILL_TIMEOUT_S:g} s" in err["message"]
    assert PREFILL_TIMEOUT_S <= elapsed < PREFILL_TIMEOUT_S + 5
    prefill = serve.get_deployment_handle("prefill", app_name="fakes")
    deadline = time.monotonic() + 15
    while not prefill.cancelled.remote().result(timeout_s=10):
        assert time.monotonic() < deadline, "the timed-out prefill call was never cancelled"
        time.sleep(0.2)


def test_token_timeout_moves_the_stream_then_is_an_error_event_naming_the_limit(fakes_url: str) -> None:
    """A decode stream silent for the token timeout moves to a live replica (`router.migration`); the
    fakes stall every attempt after two tokens, so the stream moves ``migration_limit`` times, each
    move keeping every token sent, and then ends with an error event naming the timeout and the limit."""
    limit = RouterConfig.migration_limit

    async def one() -> StreamResult:
        async with httpx.AsyncClient(timeout=30) as client:
            return await stream_request(client, f"{fakes_url}/v1/completions",
                                        completion_body(ids("STALL now"), 20))

    res = asyncio.run(one())
    assert res.status == 200 and res.done and res.error is not None
    err = res.error
    silent_s = res.t_end - res.t_start
    print(f"token timeout: {len(res.texts)} tokens, then after {silent_s:.2f} s: {err}")
    # token 0 from the prefill + two decode tokens, then two more on each of the `limit` continuations
    assert len(res.texts) == 3 + 2 * limit
    assert err["code"] == "stream_error" and f"within {TOKEN_TIMEOUT_S:g} s" in err["message"]
    assert f"migration_limit is {limit}" in err["message"]
    assert set(err) == {"message", "type", "param", "code"}
    attempts = limit + 1  # each one silent for the token timeout before it is left
    assert attempts * TOKEN_TIMEOUT_S <= silent_s < attempts * TOKEN_TIMEOUT_S + 10
    decode = serve.get_deployment_handle("decode", app_name="fakes")
    deadline = time.monotonic() + 15
    while res.request_id not in decode.cancelled.remote().result(timeout_s=10):
        assert time.monotonic() < deadline, "the silent decode stream was never cancelled"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def pull_url(serve_base: str, tiny_model: str) -> Iterator[str]:
    args = cluster_args(tiny_model, kv={"timeout_s": PULL_TIMEOUT_S}, limits={"token_timeout_s": 30})
    app = compose_app(ClusterConfig.from_args(args), prefill_cls=SilentSourcePrefill)
    with deploy(app, PULL, serve_base) as url:
        yield url


def test_kv_pull_timeout_ends_the_stream_and_frees_the_blocks(pull_url: str) -> None:
    async def one() -> StreamResult:
        async with httpx.AsyncClient(timeout=60) as client:
            return await stream_request(client, f"{pull_url}/v1/completions", completion_body("pull me", 8))

    res = asyncio.run(one())
    took = res.t_end - res.t_start
    err = res.error
    print(f"pull timeout: token 0, then after {took:.2f} s (2 pulls of limit {PULL_TIMEOUT_S} s): {err}")
    assert res.status == 200 and res.done and len(res.texts) == 1
    assert err is not None and "KV transfer failed" in err["message"] and err["code"] == "stream_error"
    assert 2 * PULL_TIMEOUT_S <= took < 2 * PULL_TIMEOUT_S + 5  # two pulls: the first, and the rebuilt one
    stats = serve.get_deployment_handle("decode", app_name=PULL).stats.remote().result(timeout_s=30)
    assert (stats["kv_blocks_used"], stats["streams"]) == (0, 0)
