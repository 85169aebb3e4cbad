"""The serving benchmark's client and targets against a scripted OpenAI stream (no server, no model):
TTFT / TPOT / ITL / tokens per chunk as `vllm bench serve` defines them, short answers as errors,
identical prompts for every server, and the targets' verdicts from known figures."""

from __future__ import annotations

import json

import httpx
import pytest

from loadtests.bench_serving import engine_counters, targets
from loadtests.serving_client import Level, random_prompts, request_body, run_level

pytestmark = pytest.mark.timeout(60)


def _sse(chunks: list[dict[str, object]]) -> bytes:
    return b"".join(f"data: {json.dumps(c)}\n\n".encode() for c in chunks) + b"data: [DONE]\n\n"


def _server(tokens_per_chunk: int, short_by: int = 0) -> httpx.MockTransport:
    seen: list[dict[str, object]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append(body)
        n = int(body["max_tokens"]) - short_by
        chunks: list[dict[str, object]] = [{"choices": [{"text": "x" * tokens_per_chunk}]}
                                           for _ in range(0, n, tokens_per_chunk)]
        chunks.append({"choices": [], "usage": {"completion_tokens": n}})
        return httpx.Response(200, content=_sse(chunks), headers={"content-type": "text/event-stream"})

    t = httpx.MockTransport(handler)
    t.seen = seen  # type: ignore[attr-defined]
    return t


async def test_a_level_counts_every_request_and_chunk() -> None:
    lv = Level(prompt_len=8, output_len=12, users=3, num_requests=7)
    transport = _server(tokens_per_chunk=3)
    res = await run_level("http://peer", "m", lv, random_prompts(7, 8, 1000, seed=1), transport=transport)
    assert res.completed == 7 and not res.errors
    assert res.tokens_per_chunk == pytest.approx(3.0)
    assert res.ttft_ms["n"] == 7 and res.tpot_ms["n"] == 7 and res.itl_ms["n"] == 7 * 3  # 4 chunks, 3 gaps
    assert res.output_tok_s > 0
    bodies = transport.seen  # type: ignore[attr-defined]
    assert all(b["ignore_eos"] is True and b["temperature"] == 0.0 and b["stream"] is True for b in bodies)
    assert sorted(len(b["prompt"]) for b in bodies) == [8] * 7


async def test_a_short_answer_is_an_error_not_a_sample() -> None:
    lv = Level(prompt_len=4, output_len=10, users=1, num_requests=2)
    res = await run_level("http://peer", "m", lv, random_prompts(2, 4, 1000, seed=2),
                          transport=_server(tokens_per_chunk=1, short_by=1))
    assert res.completed == 0 and len(res.errors) == 2 and "9 tokens generated" in res.errors[0]


def test_prompts_are_seeded_and_avoid_the_special_ends() -> None:
    a, b = random_prompts(3, 50, 49152, seed=7), random_prompts(3, 50, 49152, seed=7)
    assert a == b and a != random_prompts(3, 50, 49152, seed=8)
    assert all(200 <= t < 49152 - 200 for p in a for t in p)
    assert request_body("m", a[0], 5)["prompt"] == a[0]


def test_targets_compare_like_with_like() -> None:
    def server(ttft: float, tpot: float, tok_s: float, ratio: float | None = None) -> dict[str, object]:
        levels = []
        for prompt_len, users in ((128, 1), (128, 8), (1024, 1)):
            levels.append({"prompt_len": prompt_len, "users": users, "ttft_ms": {"p50": ttft},
                           "tpot_ms": {"p50": tpot}, "output_tok_s": tok_s, "tpot_over_engine_step": ratio})
        return {"levels": levels}

    got = {t["description"].rsplit(" (", 1)[0]: t for t in targets({"colocated": server(300, 20, 200, 1.1),
                                            "disaggregated": server(600, 30, 100, 1.5),
                                            "vllm": server(400, 25, 150)})}
    assert got["colocated vs vLLM: TTFT at 1,024 tokens, 1 user"]["value"] == 0.75
    assert got["colocated vs vLLM: TTFT at 1,024 tokens, 1 user"]["met"] is True
    assert got["colocated vs vLLM: output tok/s, 8 users"]["met"] is True
    assert got["disaggregated vs vLLM: TPOT, 1 user(s)"]["met"] is False
    assert got["disaggregated vs vLLM: TTFT at 1,024 tokens, 1 user"]["met"] is True  # 1.5 <= 1.7
    assert got["colocated: TPOT / the engine's own step, 8 user(s)"]["met"] is True
    assert got["disaggregated: TPOT / the engine's own step, 1 user(s)"]["met"] is False
    missing = targets({"colocated": server(300, 20, 200)})
    assert all(t["met"] is None and t["value"] is None for t in missing if "vLLM" in t["description"])


def test_engine_counters_sum_the_decode_replicas(monkeypatch: pytest.MonkeyPatch) -> None:
    text = "\n".join([
        'pdserve:engine_steps_total{replica="a",role="decode"} 10.0',
        'pdserve:engine_steps_total{replica="b",role="decode"} 5.0',
        'pdserve:engine_step_seconds_total{replica="a",role="decode"} 0.5',
        'pdserve:engine_step_sequences_total{replica="a",role="decode"} 40.0',
        'pdserve:engine_step_cpu_seconds_total{replica="a",role="decode"} 0.25',
    ])
    monkeypatch.setattr(httpx, "get", lambda *a, **k: httpx.Response(200, text=text))
    assert engine_counters("http://x") == (15.0, 0.5, 40.0, 0.25)
    monkeypatch.setattr(httpx, "get", lambda *a, **k: httpx.Response(200, text="other 1"))
    assert engine_counters("http://x") is None


def test_a_result_document_validates_and_plots(tmp_path) -> None:
    from loadtests.bench_common import result_doc, write_result
    from loadtests.bench_serving import plot
    from loadtests.schemas import SERVING_SCHEMA
    from loadtests.serving_client import LevelResult

    lv = Level(128, 64, 1, 2)
    summary = {"n": 2, "mean": 1.0, "p50": 1.0, "p90": 1.0, "p99": 1.0, "max": 1.0}
    level = LevelResult(lv, 1.0, 2, [], summary, summary, summary, 12.5, 1.0).as_json()
    pd_level = {**level, "engine_step_ms": 0.9, "tpot_over_engine_step": 1.11, "in_server_step_ms": 0.95,
                "in_server_step_cpu_ms": 0.9, "in_server_batch": 1.0, "tpot_over_in_server_step": 1.05}
    servers = {"disaggregated": {"kind": "pdserve", "levels": [pd_level],
                                 "engine": {"dtype": "bfloat16", "decode_step_ms": {"1x160": 0.9},
                                            "prefill_1024_ms": 5.0}},
               "vllm": {"kind": "vllm", "skipped": "not installed here"}}
    setup = {"description": "synthetic", "levels": [{"name": lv.name, **lv.__dict__}]}
    doc = result_doc("serving", setup, {}, {"servers": servers, "targets": targets(servers)},
                     {"cpu": "synthetic", "cpus": 2})
    out = write_result(tmp_path / "serving.json", doc, SERVING_SCHEMA)
    plot(doc, out.with_suffix(".png"))
    assert out.with_suffix(".png").stat().st_size > 10_000
