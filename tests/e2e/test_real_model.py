"""The real stack on a real local Ray Serve: bundled SmolLM2, real replicas, KV over gloo.

Two apps on the package's Ray cluster (tests/e2e/conftest.py): ``/pd`` (1 prefill + 1 decode replica)
and ``/colo`` (the colocated baseline). Oracles: the reference `generate()` in this process for greedy text, the
tokenizer for usage counts, the official `openai` client for the API.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest
from ray import serve

from cluster.app import compose_app
from cluster.config import ClusterConfig
from engine.config import EngineConfig
from engine.engine import Engine
from engine.generate import generate
from engine.loading.bundled import DEFAULT_MODEL, prepare_model
from engine.sampling.grammar import GrammarSpec
from engine.sampling.sampler import SamplingParams
from engine.tokenizer import Tokenizer
from tests.support.prompt_logprobs_oracle import hf_prompt_logprobs
from tests.support.serve_harness import deploy

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colors."}],
]


def _args(mode: str) -> dict[str, Any]:
    pool = {"num_replicas": 1, "num_cpus": 0.2, "num_blocks": 192, "max_num_seqs": 48}
    args: dict[str, Any] = {
        "model": DEFAULT_MODEL,
        "mode": mode,
        "engine": {"dtype": "float32", "block_size": 16, "num_threads": 1},
        "decode": dict(pool),
        "router": {"num_replicas": 1, "num_cpus": 0.1},
        "kv": {"transport": "gloo", "host": "127.0.0.1", "secret": "e2e-secret-0123456789abcdef", "lease_s": 30},
        "limits": {"max_model_len": 2048},
    }
    if mode == "disaggregated":
        args["prefill"] = dict(pool)
        args["router"]["prefill_path"] = "remote"  # every prompt via the prefill replica (auto: test_path_choice_pd)
    else:
        args["decode"]["prefill_chunk_size"] = 64
    return args


@pytest.fixture(scope="module")
def cluster(serve_base: str) -> Iterator[str]:
    prepare_model(DEFAULT_MODEL, progress=False)
    with deploy(compose_app(ClusterConfig.from_args(_args("disaggregated"))), "pd", serve_base), \
            deploy(compose_app(ClusterConfig.from_args(_args("colocated"))), "colo", serve_base):
        yield serve_base


@pytest.fixture(scope="module")
def oracle() -> tuple[Engine, Tokenizer]:
    folder = prepare_model(DEFAULT_MODEL, progress=False)
    return Engine.from_dir(folder, EngineConfig(num_blocks=64, block_size=16)), Tokenizer.from_dir(folder)


def client(base: str, app: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/{app}/v1", api_key="unused", timeout=120, max_retries=0)


def reference_text(oracle: tuple[Engine, Tokenizer], messages: list[dict[str, str]], n: int) -> tuple[str, int, int]:
    eng, tok = oracle
    ids = tok.encode_chat(messages)
    out = generate(eng, ids, SamplingParams(max_tokens=n), eos_token_ids=tok.eos_token_ids)
    return tok.decode(out.token_ids), len(ids), len(out.token_ids)


@pytest.mark.parametrize("app", ["pd", "colo"])
def test_greedy_chat_over_http_equals_reference(cluster: str, oracle, app: str) -> None:
    c = client(cluster, app)
    for messages in CHATS:
        want, n_prompt, n_out = reference_text(oracle, messages, 24)
        got = c.chat.completions.create(model=DEFAULT_MODEL, messages=messages, max_tokens=24, temperature=0)
        assert got.choices[0].message.content == want
        assert got.usage is not None
        assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (n_prompt, n_out)
        stream = c.chat.completions.create(
            model=DEFAULT_MODEL, messages=messages, max_tokens=24, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
        parts, usage = [], None
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                parts.append(chunk.choices[0].delta.content)
            usage = chunk.usage or usage
        assert "".join(parts) == want
        assert usage is not None and usage.completion_tokens == n_out


def test_usage_counts_the_prompt_tokens_served_from_the_prefix_cache(cluster: str) -> None:
    """The same long prompt twice: the second prefill reuses the first one's full blocks, and usage
    says how many prompt tokens that was; the colocated pool has no prefix cache and says 0."""
    text = " ".join(f"item {i} is number {i * 7} in the list;" for i in range(24)) + " Summarize."
    messages = [{"role": "user", "content": text}]
    first, second = (client(cluster, "pd").chat.completions.create(
        model=DEFAULT_MODEL, messages=messages, max_tokens=2, temperature=0) for _ in range(2))
    assert first.usage is not None and second.usage is not None
    assert first.usage.prompt_tokens_details is not None and second.usage.prompt_tokens_details is not None
    n = second.usage.prompt_tokens
    # the first may reuse the chat template's default system prompt, which other tests sent before
    assert first.usage.prompt_tokens_details.cached_tokens < (n - 1) // 16 * 16
    # every full block of the prompt but its last token
    assert second.usage.prompt_tokens_details.cached_tokens == (n - 1) // 16 * 16
    colo = client(cluster, "colo").chat.completions.create(model=DEFAULT_MODEL, messages=messages, max_tokens=2,
                                                          temperature=0)
    assert colo.usage is not None and colo.usage.prompt_tokens_details is not None
    assert colo.usage.prompt_tokens_details.cached_tokens == 0


@pytest.mark.parametrize("app", ["pd", "colo"])
def test_echo_returns_the_prompt_then_the_same_completion(cluster: str, app: str) -> None:
    c = client(cluster, app)
    prompt = "The capital of France is"
    plain = c.completions.create(model=DEFAULT_MODEL, prompt=prompt, max_tokens=8, temperature=0)
    echoed = c.completions.create(model=DEFAULT_MODEL, prompt=prompt, max_tokens=8, temperature=0, echo=True)
    assert echoed.choices[0].text == prompt + plain.choices[0].text
    parts = [ch.choices[0].text for ch in c.completions.create(
        model=DEFAULT_MODEL, prompt=prompt, max_tokens=8, temperature=0, echo=True, stream=True) if ch.choices]
    assert parts[0].startswith(prompt) and "".join(parts) == echoed.choices[0].text


@pytest.fixture(scope="module")
def hf_model() -> Any:
    import torch
    import transformers

    folder = prepare_model(DEFAULT_MODEL, progress=False)
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.mark.parametrize("app", ["pd", "colo"])
def test_echo_with_logprobs_gives_the_prompt_tokens_log_probs_of_transformers(
        cluster: str, oracle, hf_model, app: str) -> None:
    """Legacy completions' echo + logprobs: the prompt's tokens first (the first without a log-prob),
    their log-probs and top 3 those of transformers' log-softmax; streamed, the same entries."""
    _, tok = oracle
    c = client(cluster, app)
    prompt = "The capital of France is Paris, and the capital of Italy is"
    ids = tok.encode_prompt(prompt)
    ref = hf_prompt_logprobs(hf_model, ids, 3)
    kw: dict[str, Any] = dict(model=DEFAULT_MODEL, prompt=prompt, max_tokens=4, temperature=0, echo=True, logprobs=3)
    got = c.completions.create(**kw).choices[0]
    plain = c.completions.create(**{**kw, "echo": False}).choices[0]
    lp, n = got.logprobs, len(ids)
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert got.text == prompt + plain.text
    assert lp.tokens[:n] == [tok.decode([i]) for i in ids] and len(lp.tokens) == n + 4
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert max(abs(a - b) for a, b in zip(lp.token_logprobs[1:n], ref.token_logprobs, strict=True)) < 1e-4  # type: ignore[operator]
    for top, want_ids, want in zip(lp.top_logprobs[1:n], ref.top_ids, ref.top_logprobs, strict=True):
        assert all(abs(top[tok.decode([t])] - v) < 1e-4 for t, v in zip(want_ids, want, strict=True))
    assert plain.logprobs is not None and lp.token_logprobs[n:] == plain.logprobs.token_logprobs
    chunks = [ch.choices[0] for ch in c.completions.create(**kw, stream=True) if ch.choices]
    assert [t for ch in chunks for t in ch.logprobs.tokens] == lp.tokens  # type: ignore[union-attr]
    streamed = [x for ch in chunks for x in ch.logprobs.token_logprobs]  # type: ignore[union-attr]
    assert streamed[0] is None
    assert max(abs(a - b) for a, b in zip(streamed[1:], lp.token_logprobs[1:], strict=True)) < 1e-4


@pytest.mark.parametrize("app", ["pd", "colo"])
def test_chat_prompt_logprobs_equal_transformers(cluster: str, oracle, hf_model, app: str) -> None:
    """vLLM's prompt_logprobs on chat (a prompt the prefix cache holds, on pd: computed whole anyway):
    per position the prompt token's log-prob and rank, and the top 2 ranked 1 and 2."""
    _, tok = oracle
    ids = tok.encode_chat(CHATS[0])
    ref = hf_prompt_logprobs(hf_model, ids, 2)
    kw: dict[str, Any] = dict(model=DEFAULT_MODEL, messages=CHATS[0], max_tokens=2, temperature=0)
    client(cluster, app).chat.completions.create(**kw)  # on pd, its full blocks are in the prefix cache now
    got = client(cluster, app).chat.completions.create(**kw, extra_body={"prompt_logprobs": 2})
    assert got.usage is not None and got.usage.prompt_tokens_details is not None
    assert got.usage.prompt_tokens_details.cached_tokens == 0
    entries = got.model_extra["prompt_logprobs"]  # type: ignore[index]
    assert got.usage is not None and len(entries) == len(ids) == got.usage.prompt_tokens and entries[0] is None
    for i, entry in enumerate(entries[1:]):
        own = entry[str(ids[i + 1])]
        lo, hi = ref.rank_bounds[i]
        assert abs(own["logprob"] - ref.token_logprobs[i]) < 1e-4 and lo <= own["rank"] <= hi
        assert own["decoded_token"] == tok.decode([ids[i + 1]], skip_special_tokens=False)  # as vLLM decodes
        for rank, (t, v) in enumerate(zip(ref.top_ids[i], ref.top_logprobs[i], strict=True), 1):
            assert abs(entry[str(t)]["logprob"] - v) < 1e-4 and entry[str(t)]["rank"] in (rank, own["rank"])


def test_seeded_sampling_is_reproducible_across_modes(cluster: str) -> None:
    """Per-token seeding: the same seed gives the same text, disaggregated or colocated."""
    kw: dict[str, Any] = dict(model=DEFAULT_MODEL, prompt="Once upon a time", max_tokens=20, temperature=0.9, seed=7)
    a = client(cluster, "pd").completions.create(**kw).choices[0].text
    b = client(cluster, "pd").completions.create(**kw).choices[0].text
    c = client(cluster, "colo").completions.create(**kw).choices[0].text
    other = client(cluster, "pd").completions.create(**{**kw, "seed": 8}).choices[0].text
    assert a == b == c
    assert other != a


@pytest.mark.parametrize("app", ["pd", "colo"])
def test_penalties_and_top_logprobs_over_http_equal_reference(cluster: str, oracle, app: str) -> None:
    """The sampler's new fields through the whole stack: the text of the in-process reference with
    the same params, and each token's log-prob first among its top_logprobs when greedy."""
    eng, tok = oracle
    messages = CHATS[1]
    params = SamplingParams(max_tokens=24, repetition_penalty=1.3, presence_penalty=0.5,
                            logit_bias=((tok.encode(" red")[0], -100.0),))
    want = tok.decode(generate(eng, tok.encode_chat(messages), params, eos_token_ids=tok.eos_token_ids).token_ids)
    got = client(cluster, app).chat.completions.create(
        model=DEFAULT_MODEL, messages=messages, max_tokens=24, temperature=0, presence_penalty=0.5,
        logit_bias={str(tok.encode(" red")[0]): -100}, logprobs=True, top_logprobs=3,
        extra_body={"repetition_penalty": 1.3})
    assert got.choices[0].message.content == want
    content = got.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content and all(len(t.top_logprobs) == 3 for t in content)
    assert all(t.top_logprobs[0].logprob >= t.logprob for t in content)


@pytest.mark.parametrize("app", ["pd", "colo"])
def test_n_choices_share_one_prompt(cluster: str, oracle, app: str) -> None:
    """n greedy choices are the reference text each; n seeded choices are reproducible and choice 0
    is the n = 1 text of the same seed; streamed chunks carry indices 0..n-1; usage sums the choices."""
    c = client(cluster, app)
    messages = CHATS[0]
    want, n_prompt, n_out = reference_text(oracle, messages, 16)
    greedy = c.chat.completions.create(model=DEFAULT_MODEL, messages=messages, max_tokens=16, temperature=0, n=3)
    assert [ch.index for ch in greedy.choices] == [0, 1, 2]
    assert [ch.message.content for ch in greedy.choices] == [want] * 3
    assert greedy.usage is not None and (greedy.usage.prompt_tokens, greedy.usage.completion_tokens) == (n_prompt,
                                                                                                       3 * n_out)
    kw: dict[str, Any] = dict(model=DEFAULT_MODEL, prompt="Once upon a time", max_tokens=16, temperature=1.0, seed=11,
                              logprobs=0)
    a, b = (c.completions.create(**kw, n=2) for _ in range(2))
    one = c.completions.create(**kw)
    assert [ch.text for ch in a.choices] == [ch.text for ch in b.choices]
    assert a.choices[0].text == one.choices[0].text and a.choices[1].text != a.choices[0].text
    stream = c.completions.create(**kw, n=2, stream=True, stream_options={"include_usage": True})
    parts: dict[int, list[str]] = {0: [], 1: []}
    usage = None
    for chunk in stream:
        for ch in chunk.choices:
            parts[ch.index].append(ch.text)
        usage = chunk.usage or usage
    assert ["".join(parts[i]) for i in range(2)] == [ch.text for ch in a.choices]
    assert usage is not None and a.usage is not None and usage.completion_tokens == a.usage.completion_tokens
    assert a.usage.prompt_tokens == one.usage.prompt_tokens  # type: ignore[union-attr]
    assert a.usage.completion_tokens == sum(len(ch.logprobs.tokens or ()) for ch in a.choices)  # type: ignore[union-attr]


@pytest.mark.parametrize("app", ["pd", "colo"])
def test_a_client_leaving_n_choices_frees_every_block(cluster: str, app: str) -> None:
    """A stream of 3 choices closed after a few chunks: the decode replica ends all three long before
    their 300 tokens and its block books (checked for integrity by ``stats``) hold nothing once idle."""
    import time

    decode = serve.get_deployment_handle("decode", app_name=app)
    steps = decode.stats.remote().result(timeout_s=30)["steps"]
    stream = client(cluster, app).completions.create(
        model=DEFAULT_MODEL, prompt="Write a long story about a dragon", max_tokens=300, temperature=0.8, n=3,
        stream=True, extra_body={"ignore_eos": True})
    seen: set[int] = set()
    for chunk in stream:
        seen.update(ch.index for ch in chunk.choices)
        if len(seen) == 3:
            break
    stream.close()
    deadline = time.monotonic() + 60
    while (d := decode.stats.remote().result(timeout_s=30))["kv_blocks_used"] or d["streams"]:
        assert time.monotonic() < deadline, d
        time.sleep(0.2)
    assert d["steps"] - steps < 299  # aborted: the choices did not run to their end
CITY_SCHEMA = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "London", "Berlin", "Rome"]},
                   "population_millions": {"type": "integer", "minimum": 0, "maximum": 50},
                   "capital": {"type": "boolean"}},
    "required": ["city", "population_millions", "capital"],
    "additionalProperties": False,
}
CITY = [{"role": "user", "content": "Give the capital of France as JSON with its population in millions."}]


def test_structured_outputs_parse_and_validate_in_both_modes(cluster: str, oracle) -> None:
    """json_schema greedy (the reference's text under the same grammar), seeded and streamed (the
    same text in both modes: token 0 under the grammar on the prefill replica, the rest on the
    decode replica), json_object on completions; a schema llguidance cannot compile is a 400."""
    eng, tok = oracle
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY_SCHEMA, "strict": True}}
    params = SamplingParams(max_tokens=60, grammar=GrammarSpec("json_schema", json.dumps(CITY_SCHEMA)))
    want = tok.decode(generate(eng, tok.encode_chat(CITY), params, eos_token_ids=tok.eos_token_ids).token_ids)
    seeded = []
    for app in ("pd", "colo"):
        c = client(cluster, app)
        got = c.chat.completions.create(model=DEFAULT_MODEL, messages=CITY, max_tokens=60, temperature=0,
                                        response_format=fmt).choices[0]
        assert got.finish_reason == "stop" and got.message.content == want
        jsonschema.validate(json.loads(want), CITY_SCHEMA)
        chunks = list(c.chat.completions.create(model=DEFAULT_MODEL, messages=CITY, max_tokens=60, temperature=0.8,
                                                seed=3, response_format=fmt, stream=True))
        seeded.append("".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices))
        assert chunks[-1].choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(seeded[-1]), CITY_SCHEMA)
        obj = c.completions.create(model=DEFAULT_MODEL, prompt="A JSON object describing a cat:", max_tokens=60,
                                   temperature=0, extra_body={"response_format": {"type": "json_object"}})
        assert obj.choices[0].finish_reason == "stop" and isinstance(json.loads(obj.choices[0].text), dict)
        bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model=DEFAULT_MODEL, messages=CITY, max_tokens=8, response_format=bad)  # type: ignore[arg-type]
        assert e.value.body["param"] == "response_format"  # type: ignore[index]
    assert seeded[0] == seeded[1]


WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                  "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                  "required": ["city", "days"], "additionalProperties": False}
TOOLS: Any = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMS}},
              {"type": "function", "function": {"name": "get_time", "parameters": {
                  "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}]
FORECAST: Any = [{"role": "user", "content": "What will the weather be in Paris for the next 3 days?"}]


def test_tool_calls_on_a_template_without_tools_in_both_modes(cluster: str, oracle) -> None:
    """SmolLM2's template cannot show the model its tools: ``auto`` is a 400 naming tools; a named
    function is the grammar-constrained arguments (the reference's text under the parameters schema),
    which parse and validate, streamed the same; ``required`` calls validate against their tool."""
    eng, tok = oracle
    params = SamplingParams(max_tokens=40, grammar=GrammarSpec("json_schema", json.dumps(WEATHER_PARAMS)))
    want = tok.decode(generate(eng, tok.encode_chat(FORECAST), params, eos_token_ids=tok.eos_token_ids).token_ids)
    named: Any = {"type": "function", "function": {"name": "get_weather"}}
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for app in ("pd", "colo"):
        c = client(cluster, app)
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model=DEFAULT_MODEL, messages=FORECAST, tools=TOOLS, max_tokens=8)
        assert e.value.body["param"] == "tools"  # type: ignore[index]
        got = c.chat.completions.create(model=DEFAULT_MODEL, messages=FORECAST, tools=TOOLS, tool_choice=named,
                                        max_tokens=40, temperature=0).choices[0]
        assert got.finish_reason == "stop" and got.message.content is None and got.message.tool_calls
        (call,) = got.message.tool_calls
        assert call.function.name == "get_weather" and call.function.arguments == want  # type: ignore[union-attr]
        jsonschema.validate(json.loads(call.function.arguments), WEATHER_PARAMS)  # type: ignore[union-attr]
        with c.chat.completions.stream(model=DEFAULT_MODEL, messages=FORECAST, tools=TOOLS, tool_choice=named,
                                       max_tokens=40, temperature=0) as stream:
            (streamed,) = stream.get_final_completion().choices[0].message.tool_calls or []
        assert streamed.function.arguments == want  # type: ignore[union-attr]
        required = c.chat.completions.create(model=DEFAULT_MODEL, messages=FORECAST, tools=TOOLS,
                                             tool_choice="required", max_tokens=80, temperature=0).choices[0]
        assert required.finish_reason == "tool_calls" and required.message.tool_calls
        for call in required.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments),  # type: ignore[union-attr]
                                schemas[call.function.name])  # type: ignore[union-attr]


def test_32_concurrent_streams_complete(cluster: str) -> None:
    aclient = openai.AsyncOpenAI(base_url=f"{cluster}/pd/v1", api_key="unused", timeout=240, max_retries=0)

    async def one(i: int) -> int:
        stream = await aclient.completions.create(
            model=DEFAULT_MODEL, prompt=f"Request number {i}: tell me a story about", max_tokens=12,
            temperature=0, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
        usage = None
        async for chunk in stream:
            usage = chunk.usage or usage
        assert usage is not None
        return usage.completion_tokens

    async def main() -> list[int]:
        try:
            return await asyncio.gather(*(one(i) for i in range(32)))
        finally:
            await aclient.close()

    assert asyncio.run(main()) == [12] * 32


def test_books_are_whole_at_idle(cluster: str) -> None:
    """After all the traffic above: no block held, no lease left, integrity checks pass."""
    import time

    prefill = serve.get_deployment_handle("prefill", app_name="pd")
    decode = serve.get_deployment_handle("decode", app_name="pd")
    deadline = time.monotonic() + 30
    while True:
        p = prefill.stats.remote().result(timeout_s=30)
        d = decode.stats.remote().result(timeout_s=30)
        if (p["outbox_pending"], p["kv_blocks_used"], d["kv_blocks_used"], d["streams"]) == (0, 0, 0, 0):
            break
        assert time.monotonic() < deadline, (p, d)
        time.sleep(0.2)
    assert p["source"]["transfers"] > 0


def test_models_and_bad_input(cluster: str) -> None:
    import httpx

    models = client(cluster, "pd").models.list()
    assert [m.id for m in models.data] == [DEFAULT_MODEL]
    r = httpx.post(f"{cluster}/pd/v1/completions", json={"model": DEFAULT_MODEL, "prompt": "x" * 1, "n": 17})
    assert r.status_code == 400 and r.json()["error"]["message"]
    long_prompt = list(range(100, 2200))
    body = {"model": DEFAULT_MODEL, "prompt": long_prompt, "max_tokens": 4}
    r = httpx.post(f"{cluster}/pd/v1/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
