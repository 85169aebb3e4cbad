"""Graceful drain on a redeploy: a stream in flight when its replicas are replaced runs to its end
(Serve keeps the stopping router and decode replicas until their ongoing requests finish, within
``drain.timeout_s``), while new requests already go to the new replicas and succeed."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import httpx
import pytest

from engine.config import EngineConfig
from engine.engine import Engine
from engine.generate import generate
from engine.sampling.sampler import SamplingParams
from engine.tokenizer import Tokenizer
from tests.support.multinode import APP, Deployed, app_args, completion

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

PROMPT = list(range(2000, 2032))
LONG = 2000
CHECKED = 300  # tokens compared with the reference (the rest are counted)


def replica_states() -> dict[str, dict[str, tuple[str, int | None]]]:
    """deployment → replica id → (state, pid), every replica Serve still knows of."""
    from ray.serve.context import _get_global_client

    client = _get_global_client()
    assert client is not None
    deps = client.get_serve_details()["applications"][APP]["deployments"]
    return {name: {r["replica_id"]: (r["state"], r.get("pid")) for r in d["replicas"]} for name, d in deps.items()}


class Stream(threading.Thread):
    """A long greedy stream read to its end, recording each event's arrival."""

    def __init__(self, base: str, n: int) -> None:
        super().__init__(daemon=True)
        self.base, self.n = base, n
        self.events: list[dict[str, Any]] = []

        self.done_marker = False
        self.error: BaseException | None = None

    def run(self) -> None:
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": self.n, "temperature": 0, "ignore_eos": True,
                "logprobs": 1, "stream": True}
        try:
            with httpx.stream("POST", f"{self.base}/v1/completions", json=body, timeout=60) as r:
                assert r.status_code == 200, r.read()
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        self.done_marker = True
                    elif line.startswith("data: "):
                        self.events.append(json.loads(line[6:]))

        except BaseException as e:  # surfaced by the test
            self.error = e


def test_inflight_stream_survives_a_redeploy_and_new_requests_go_to_new_replicas(deployed: Deployed) -> None:
    from ray import serve

    before = replica_states()
    old_decode = {rid for rid, (state, _) in before["decode"].items() if state == "RUNNING"}
    old_pids = {pid for _, pid in before["decode"].values()}
    stream = Stream(deployed.base_url, LONG)
    stream.start()
    deadline = time.monotonic() + 30
    while len(stream.events) < 20 and stream.is_alive():
        assert time.monotonic() < deadline, "the stream did not start"
        time.sleep(0.01)

    seen_draining: list[bool] = []  # the old decode replica was STOPPING while our stream still ran

    def watch() -> None:
        while stream.is_alive():
            states = replica_states()["decode"]
            if any(states.get(rid, ("gone",))[0] == "STOPPING" for rid in old_decode):
                seen_draining.append(stream.is_alive())
                return
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    # A changed decode config: serve.run replaces the app's replicas (router, prefill, decode).
    deployed.deploy(app_args(deployed.model, max_num_seqs=32))

    # New requests succeed, and on the new replicas: the new decode replica has stepped, and nothing
    # but these requests reached it.
    ref_engine = Engine.from_dir(deployed.model, EngineConfig(num_blocks=256))
    tok = Tokenizer.from_dir(deployed.model)
    short = [5, 6, 7, 8, 9]
    ref = generate(ref_engine, short, SamplingParams(max_tokens=10, ignore_eos=True)).token_ids
    for _ in range(3):
        assert completion(deployed.base_url, short, 10)["choices"][0]["text"] == tok.decode(ref)
    new_stats = serve.get_deployment_handle("decode", app_name=APP).stats.remote().result()
    assert new_stats["pid"] not in old_pids and new_stats["steps"] > 0

    stream.join(timeout=90)
    watcher.join(timeout=5)
    assert not stream.is_alive(), "the in-flight stream hung"
    assert stream.error is None, repr(stream.error)
    assert stream.done_marker
    assert all("error" not in e for e in stream.events), [e for e in stream.events if "error" in e]
    assert seen_draining == [True], "never saw the old decode replica draining during the stream"
    tokens = [t for e in stream.events for t in e["choices"][0]["logprobs"]["tokens"]]
    assert len(tokens) == LONG and stream.events[-1]["choices"][0]["finish_reason"] == "length"
    head = generate(ref_engine, PROMPT, SamplingParams(max_tokens=CHECKED, ignore_eos=True)).token_ids
    assert tokens[:CHECKED] == [tok.decode([t], skip_special_tokens=False) for t in head]

    # Drained replicas go away; only the new ones remain.
    deadline = time.monotonic() + 30
    while any(rid in replica_states()["decode"] for rid in old_decode):
        assert time.monotonic() < deadline, replica_states()["decode"]
        time.sleep(0.2)


def ready_status(base: str) -> int:
    return httpx.get(f"{base}/ready", timeout=10).status_code


def test_drain_turns_ready_false_first_then_waits_for_the_streams(deployed: Deployed) -> None:
    """`cluster.drain`: /ready answers 503 while a stream still runs; what arrives meanwhile is
    served; the drain returns only once the stream is over; undrain puts the app back."""
    from cluster.drain import DrainResult, drain_app, undrain

    assert ready_status(deployed.base_url) == 200
    stream = Stream(deployed.base_url, 800)
    stream.start()
    deadline = time.monotonic() + 30
    while len(stream.events) < 20 and stream.is_alive():
        assert time.monotonic() < deadline, "the stream did not start"
        time.sleep(0.01)
    out: list[DrainResult] = []
    drainer = threading.Thread(target=lambda: out.append(
        drain_app(APP, deployed.base_url, announce_s=1.0, timeout_s=90)), daemon=True)
    try:
        drainer.start()
        deadline = time.monotonic() + 10
        while ready_status(deployed.base_url) != 503:
            assert time.monotonic() < deadline, "/ready never turned 503"
            time.sleep(0.05)
        stream_alive_when_unready = stream.is_alive()
        body = httpx.get(f"{deployed.base_url}/ready", timeout=10)
        assert body.json()["error"]["code"] == "draining" and int(body.headers["Retry-After"]) >= 1
        assert httpx.get(f"{deployed.base_url}/health", timeout=10).status_code == 200
        late = completion(deployed.base_url, [5, 6, 7, 8, 9], 10)  # still served while draining
        assert late["usage"]["completion_tokens"] == 10
        drainer.join(timeout=120)
        assert not drainer.is_alive() and out, "the drain did not return"
        stream_alive_when_drained = stream.is_alive()
        stream.join(timeout=60)
    finally:
        undrain(APP)
    result = out[0]
    print(f"drain: /ready 503 after {result.ready_false_s:.2f} s, drained in {result.total_s:.1f} s, "
          f"in flight at start {result.in_flight_at_start}")
    assert stream_alive_when_unready, "the stream ended before /ready turned false: nothing was tested"
    assert result.drained and not result.left
    assert any("router_requests_in_flight" in k for k in result.in_flight_at_start)
    assert not stream_alive_when_drained, "the drain returned while a stream was still running"
    assert stream.error is None and stream.done_marker
    assert all("error" not in e for e in stream.events)
    assert sum(len(e["choices"][0]["logprobs"]["tokens"]) for e in stream.events) == 800
    deadline = time.monotonic() + 10
    while ready_status(deployed.base_url) != 200:
        assert time.monotonic() < deadline, "/ready stayed 503 after undrain"
        time.sleep(0.1)
