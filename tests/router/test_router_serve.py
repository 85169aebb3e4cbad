"""The router on a real local Ray Serve, against fake pools (see pd_fakes), through the openai client.

One Ray cluster for the module, two apps: ``/pd`` (disaggregated, 2 prefill + 1 decode replica,
API keys on, prefix-affinity routing) and ``/colo`` (colocated, 1 decode replica, no keys).
"""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import ray
from ray import cloudpickle, serve

from loadtests.bench_common import free_port
from router.app import Router
from router.config import RouterConfig
from router.replica_router import serve_router_config, with_routing_stats
from tests.support import pd_fakes
from tests.support.pd_fakes import (
    FakeConfig,
    FakeDecode,
    FakePrefill,
    expected_choice_text,
    expected_text,
    fake_codec,
    successor,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

MODEL = "fake-model"
KEYS = ("key-one", "key-two")
MAX_LEN = 200
MARKER_DIR = Path(tempfile.mkdtemp(prefix="pdserve-fake-"))  # the crashing fake leaves its marker here


def _pool(cls: type, name: str, replicas: int, policy: str) -> Any:
    return serve.deployment(with_routing_stats(cls)).options(
        name=name, num_replicas=replicas, ray_actor_options={"num_cpus": 0.1}, max_ongoing_requests=200,
        request_router_config=serve_router_config(policy, stats_period_s=0.5), health_check_period_s=1)


@pytest.fixture(scope="module")
def base() -> Iterator[str]:
    os.environ["RAY_AUTH_MODE"] = "disabled"
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    cloudpickle.register_pickle_by_value(pd_fakes)
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        fake_cfg = FakeConfig(marker_dir=str(MARKER_DIR))
        common = {"served_model_name": MODEL, "model": "unused", "max_model_len": MAX_LEN,
                  "token_timeout_s": 10.0}
        pd = Router.options(name="router").bind(
            _pool(FakePrefill, "prefill", 2, "prefix_affinity").bind(fake_cfg),
            _pool(FakeDecode, "decode", 1, "least_outstanding_tokens").bind(fake_cfg),
            RouterConfig(api_keys=KEYS, prefill_path="remote", **common), fake_codec)  # the fakes' prefill path
        serve.run(pd, name="pd", route_prefix="/pd")
        colo = Router.options(name="router").bind(
            None, _pool(FakeDecode, "decode", 1, "prefix_affinity").bind(fake_cfg),
            RouterConfig(mode="colocated", **common), fake_codec)
        serve.run(colo, name="colo", route_prefix="/colo")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture
def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/pd/v1", api_key=KEYS[0], max_retries=0, timeout=30)


@pytest.fixture
def colo(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/colo/v1", api_key="anything", max_retries=0, timeout=30)


AUTH = {"Authorization": f"Bearer {KEYS[1]}"}


def test_completion_and_chat_not_streamed(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="abc", max_tokens=6)
    assert r.id.startswith("cmpl-") and r.object == "text_completion" and r.model == MODEL
    assert r.choices[0].text == "defghi" and r.choices[0].finish_reason == "length"
    assert r.usage is not None and (r.usage.prompt_tokens, r.usage.completion_tokens) == (3, 6)
    assert r.usage.total_tokens == 9
    msgs: Any = [{"role": "user", "content": "hi"}]
    c = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=5)
    prompt = "<user>hi<assistant>"
    assert c.id.startswith("chatcmpl-") and c.choices[0].message.content == expected_text(prompt, 5)
    assert c.usage is not None and c.usage.prompt_tokens == len(prompt) and c.usage.completion_tokens == 5


def test_chat_streamed_with_usage_and_parts(client: openai.OpenAI) -> None:
    msgs: Any = [{"role": "user", "content": [{"type": "text", "text": "h"}, {"type": "text", "text": "i"}]}]
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_completion_tokens=7,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected_text("<user>hi<assistant>", 7)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 7


@pytest.mark.parametrize("app", ["client", "colo"])
def test_n_choices_in_index_order_streamed_with_their_indices(app: str, request: pytest.FixtureRequest) -> None:
    c: openai.OpenAI = request.getfixturevalue(app)
    r = c.completions.create(model=MODEL, prompt="abc", max_tokens=5, n=3, stop=["fg"], echo=True)
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    # choice 0 "defgh" stops at "fg"; choice 1 "efghi" too (its own stop); choice 2 "fghij" at once
    assert [ch.text for ch in r.choices] == ["abcde", "abce", "abc"]
    assert [ch.finish_reason for ch in r.choices] == ["stop"] * 3
    assert r.usage is not None and r.usage.prompt_tokens == 3 and r.usage.completion_tokens == 4 + 3 + 2
    scored = c.completions.create(model=MODEL, prompt="abc", max_tokens=3, n=2, echo=True, logprobs=0)
    for i, ch in enumerate(scored.choices):  # each choice: the prompt's tokens first, then its own
        assert ch.logprobs is not None and ch.logprobs.token_logprobs is not None
        assert ch.logprobs.tokens == ["a", "b", "c", *expected_choice_text("abc", 3, i)]
        assert ch.logprobs.token_logprobs[0] is None and ch.text == "abc" + expected_choice_text("abc", 3, i)
    msgs: Any = [{"role": "user", "content": "hi"}]
    prompt = "<user>hi<assistant>"
    chunks = list(c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, n=2, stream=True,
                                            stream_options={"include_usage": True}))
    for i in range(2):
        mine = [ch.choices[0] for ch in chunks if ch.choices and ch.choices[0].index == i]
        assert mine[0].delta.role == "assistant" and [m.finish_reason for m in mine][-1] == "length"
        assert "".join(m.delta.content or "" for m in mine) == expected_choice_text(prompt, 4, i)
    assert chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8


def test_stop_strings_never_emitted(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="abc", max_tokens=30, stop=["ghi", "zz"])
    assert r.choices[0].text == "def" and r.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=MODEL, prompt="abc", max_tokens=30, stop="gh", stream=True)
    pieces = [c.choices[0].text for c in streamed]
    assert "".join(pieces) == "def" and all("g" not in p for p in pieces)


def test_eos_and_logprobs(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="EOSAT3", max_tokens=30, logprobs=0)
    assert r.choices[0].text == "45" and r.choices[0].finish_reason == "stop"
    assert r.usage is not None and r.usage.completion_tokens == 3
    assert r.choices[0].logprobs is not None and r.choices[0].logprobs.token_logprobs == [-0.25] * 3
    msgs: Any = [{"role": "user", "content": "x"}]
    c = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=3, logprobs=True)
    assert c.choices[0].logprobs is not None and c.choices[0].logprobs.content is not None
    assert [t.logprob for t in c.choices[0].logprobs.content] == [-0.25] * 3


@pytest.mark.parametrize(("field", "value"), [
    ("n", 17), ("response_format", {"type": "regex", "regex": "a+"}), ("tool_choice", "required"),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "nope"}}}),
    ("tools", [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]),
    ("use_beam_search", True), ("top_logprobs", 21),
])
def test_refused_fields_are_400_naming_them(client: openai.OpenAI, field: str, value: Any) -> None:
    msgs: Any = [{"role": "user", "content": "x"}]
    kw: dict[str, Any] = {field: value} if field != "use_beam_search" else {"extra_body": {field: value}}
    if field == "top_logprobs":
        kw["logprobs"] = True
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=3, **kw)
    body: Any = e.value.body
    assert e.value.status_code == 400 and body["param"] == field and field in body["message"]


def test_vllm_extensions_and_metadata(client: openai.OpenAI) -> None:
    extra = {"stop_token_ids": [ord("g")], "include_stop_str_in_output": True, "skip_special_tokens": True,
             "top_k": 5, "ignore_eos": True, "some_vendor_knob": 1, "min_p": 0.1, "repetition_penalty": 1.2,
             "min_tokens": 2}
    r = client.completions.create(model=MODEL, prompt="abc", max_tokens=30, user="u", extra_body=extra,
                                  presence_penalty=0.5, frequency_penalty=0.5, logit_bias={"65": 10})
    assert r.choices[0].text == "defg" and r.choices[0].finish_reason == "stop"
    msgs: Any = [{"role": "user", "content": "x"}]
    c = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, n=1, store=False,
                                       metadata={"k": "v"}, tool_choice="none", parallel_tool_calls=True,
                                       response_format={"type": "text"}, safety_identifier="s")
    assert c.choices[0].finish_reason == "length"


def test_tokenize_and_detokenize(base: str) -> None:
    with httpx.Client(base_url=f"{base}/pd", headers=AUTH, timeout=30) as http:
        r = http.post("/tokenize", json={"model": MODEL, "prompt": "abc", "return_token_strs": True})
        assert r.status_code == 200
        assert r.json() == {"count": 3, "max_model_len": MAX_LEN, "tokens": [97, 98, 99], "token_strs": list("abc")}
        chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
        assert chat["tokens"] == [ord(c) for c in "<user>hi<assistant>"] and chat["token_strs"] is None
        assert http.post("/detokenize", json={"tokens": [104, 105]}).json() == {"prompt": "hi"}
        for path, body, param in (("/detokenize", {"tokens": [999]}, "tokens"),
                                  ("/tokenize", {"prompt": "x", "model": "other"}, "model"),
                                  ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "tools": [{}]},
                                   "tools"),
                                  ("/tokenize", {"prompt": 5}, "prompt")):
            r = http.post(path, json=body)
            assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, (path, body)
    assert httpx.post(f"{base}/pd/tokenize", json={"prompt": "x"}, timeout=30).status_code == 401


def test_top_logprobs(client: openai.OpenAI) -> None:
    msgs: Any = [{"role": "user", "content": "x"}]
    c = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=3, logprobs=True, top_logprobs=2)
    assert c.choices[0].logprobs is not None and c.choices[0].logprobs.content is not None
    for tok in c.choices[0].logprobs.content:
        t = ord(tok.token)
        assert [(a.token, a.logprob, a.bytes) for a in tok.top_logprobs] == [
            (chr(t), -0.25, [t]), (chr(successor(t)), -1.25, [successor(t)])]
    streamed = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=3, logprobs=True,
                                                   top_logprobs=1, stream=True))
    tops = [e.top_logprobs for c in streamed for e in (c.choices[0].logprobs.content or [])  # type: ignore[union-attr]
            if c.choices and c.choices[0].logprobs]
    assert len(tops) == 3 and all(len(t) == 1 for t in tops)
    r = client.completions.create(model=MODEL, prompt="abc", max_tokens=2, logprobs=2)
    lp = r.choices[0].logprobs
    assert lp is not None and lp.top_logprobs == [{"d": -0.25, "e": -1.25}, {"e": -0.25, "f": -1.25}]
    with pytest.raises(openai.BadRequestError):  # top_logprobs needs logprobs
        client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=3, top_logprobs=2)


def test_raw_sse_ends_with_done(base: str) -> None:
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{base}/pd/v1/completions", json=body, headers=AUTH, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    assert "".join(json.loads(ln[6:])["choices"][0]["text"] for ln in lines[:-1]) == "defg"


def test_32_concurrent_streams(base: str) -> None:
    async def one(c: openai.AsyncOpenAI, i: int) -> tuple[str, int]:
        prompt = f"p{i:02d}"
        stream = await c.completions.create(model=MODEL, prompt=prompt, max_tokens=10 + i, stream=True,
                                            stream_options={"include_usage": True})
        text, usage = "", 0
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
            if chunk.usage:
                usage = chunk.usage.completion_tokens
        assert text == expected_text(prompt, 10 + i)
        return text, usage

    async def run() -> list[tuple[str, int]]:
        c = openai.AsyncOpenAI(base_url=f"{base}/pd/v1", api_key=KEYS[0], max_retries=0, timeout=60)
        return await asyncio.gather(*(one(c, i) for i in range(32)))

    results = asyncio.run(run())
    assert [u for _, u in results] == [10 + i for i in range(32)]


def _error(r: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    if code is not None:
        assert err["code"] == code
    return dict(err)


def test_bad_input_while_a_stream_is_in_flight(base: str, client: openai.OpenAI) -> None:
    result: dict[str, Any] = {}

    def stream() -> None:
        chunks = client.completions.create(model=MODEL, prompt="SLOWabc", max_tokens=40, stream=True)
        result["text"] = "".join(c.choices[0].text for c in chunks)

    t = threading.Thread(target=stream)
    t.start()
    url = f"{base}/pd/v1/completions"
    h = {**AUTH, "Content-Type": "application/json"}
    with httpx.Client(timeout=30) as http:
        _error(http.post(url, content=b"{not json", headers=h), 400)
        _error(http.post(url, content=b"[1, 2]", headers=h), 400)
        assert _error(http.post(url, json={"model": MODEL}, headers=h), 400)["param"] == "prompt"
        _error(http.post(url, json={"model": MODEL, "prompt": "a", "max_tokens": "ten"}, headers=h), 400)
        _error(http.post(url, json={"model": MODEL, "prompt": "a", "max_tokens": 0}, headers=h), 400)
        _error(http.post(url, json={"model": MODEL, "prompt": "a", "max_tokens": 10**9}, headers=h), 400,
               "context_length_exceeded")
        _error(http.post(url, json={"model": MODEL, "prompt": "x" * MAX_LEN}, headers=h), 400,
               "context_length_exceeded")
        _error(http.post(url, json={"model": "gpt-9", "prompt": "a"}, headers=h), 404, "model_not_found")
        _error(http.post(url, json={"model": MODEL, "prompt": "a", "n": 0}, headers=h), 400)
        chat = f"{base}/pd/v1/chat/completions"
        _error(http.post(chat, json={"model": MODEL, "messages": "hi"}, headers=h), 400)
        _error(http.post(chat, json={"model": MODEL, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "x"}}]}]}, headers=h), 400)
        big = json.dumps({"model": MODEL, "prompt": "a" * (1 << 20)})
        _error(http.post(url, content=big, headers=h), 413, "request_too_large")
        _error(http.get(f"{base}/pd/v1/nothing-here", headers=h), 404)
    t.join(timeout=30)
    assert result["text"] == expected_text("SLOWabc", 40)


def test_api_keys(base: str) -> None:
    with httpx.Client(timeout=30) as http:
        assert http.get(f"{base}/pd/health").status_code == 200
        assert http.get(f"{base}/pd/ready").status_code == 200
        err = _error(http.get(f"{base}/pd/v1/models"), 401, "invalid_api_key")
        assert err["type"] == "authentication_error"
        _error(http.get(f"{base}/pd/v1/models", headers={"Authorization": "Bearer nope"}), 401)
        _error(http.get(f"{base}/pd/v1/models", headers={"Authorization": KEYS[0]}), 401)
        for key in KEYS:
            r = http.get(f"{base}/pd/v1/models", headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 200 and r.json()["data"][0]["id"] == MODEL
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{base}/pd/v1", api_key="wrong", max_retries=0).completions.create(
            model=MODEL, prompt="a", max_tokens=2)


def test_queue_full_is_429_with_retry_after(base: str, client: openai.OpenAI) -> None:
    r = httpx.post(f"{base}/pd/v1/completions", json={"model": MODEL, "prompt": "QUEUEFULL"},
                   headers=AUTH, timeout=30)
    _error(r, 429, "rate_limit_exceeded")
    assert r.headers["retry-after"] == "3"
    with pytest.raises(openai.RateLimitError):
        client.completions.create(model=MODEL, prompt="QUEUEFULL", max_tokens=3, stream=True)


def test_error_mid_stream_is_an_sse_error_event(base: str) -> None:
    body = {"model": MODEL, "prompt": "MIDERR", "max_tokens": 20, "stream": True}
    with httpx.stream("POST", f"{base}/pd/v1/completions", json=body, headers=AUTH, timeout=30) as r:
        lines = [ln for ln in r.iter_lines() if ln]
    assert r.status_code == 200 and lines[-1] == "data: [DONE]"
    err = json.loads(lines[-2][6:])["error"]
    assert "fake decode failure" in err["message"] and len(lines) == 5


def test_client_disconnect_cancels_the_decode_stream(base: str) -> None:
    body = {"model": MODEL, "prompt": "SLOWxyz", "max_tokens": 150, "stream": True}
    with httpx.stream("POST", f"{base}/pd/v1/completions", json=body, headers=AUTH, timeout=30) as r:
        events = (ln for ln in r.iter_lines() if ln)
        first = json.loads(next(events)[6:])
        for _ in range(4):  # token 0 came from the prefill: read until the decode stream is running
            next(events)
    decode = serve.get_deployment_handle("decode", app_name="pd")
    deadline = time.time() + 15
    while first["id"] not in decode.cancelled.remote().result():
        assert time.time() < deadline, "decode stream was not cancelled"
        time.sleep(0.2)


def test_prefill_crash_is_retried_once(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="CRASH1abc", max_tokens=3)
    assert r.choices[0].text == "def"
    assert (MARKER_DIR / "pdserve-fake-crash1").exists()  # a replica really died on the first try


def test_metrics_after_traffic(base: str, client: openai.OpenAI) -> None:
    client.completions.create(model=MODEL, prompt="abc", max_tokens=3)
    # Gauges arrive with each replica's routing stats (about once a second each; a replica restarted
    # by an earlier test reports under its new id once it is up): wait for all three, bounded.
    deadline = time.time() + 45
    while True:
        text = httpx.get(f"{base}/pd/metrics", timeout=30).text
        if text.count('pdserve:kv_blocks_free{') >= 3 or time.time() > deadline:
            break
        time.sleep(0.5)
    samples = {ln.split(" ")[0]: float(ln.split(" ")[1]) for ln in text.splitlines()
               if ln and not ln.startswith("#")}
    for h in ("time_to_first_token_seconds", "inter_token_latency_seconds", "time_per_output_token_seconds",
              "e2e_request_latency_seconds", "request_queue_time_seconds", "request_prefill_time_seconds",
              "kv_transfer_time_seconds"):
        assert samples[f"pdserve:{h}_count"] > 0, h
    assert samples["pdserve:prompt_tokens_total"] > 0 and samples["pdserve:generation_tokens_total"] > 0
    assert samples['pdserve:request_success_total{finish_reason="length"}'] > 0
    # per-replica gauges come from the routing stats our request router publishes: 2 prefill + 1 decode
    assert sum(k.startswith("pdserve:kv_blocks_free{") for k in samples) == 3, text


def test_colocated_app(base: str, colo: openai.OpenAI) -> None:
    r = colo.completions.create(model=MODEL, prompt="abc", max_tokens=5)
    assert r.choices[0].text == "defgh" and r.usage is not None and r.usage.completion_tokens == 5
    msgs: Any = [{"role": "user", "content": "hi"}]
    chunks = list(colo.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected_text("<user>hi<assistant>", 4)
    with pytest.raises(openai.RateLimitError):
        colo.completions.create(model=MODEL, prompt="QUEUEFULL", max_tokens=3)
    assert httpx.get(f"{base}/colo/ready", timeout=30).status_code == 200
