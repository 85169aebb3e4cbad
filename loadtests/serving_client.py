"""The serving benchmark's client: the same closed-loop load against any OpenAI-compatible server.

Owns: `Level` (prompt length, output length, concurrent users, requests), `random_prompts` (token-id
prompts drawn from a seeded generator, identical for every server it is given to), `run_level`
(``users`` workers, each sending its next streamed ``/v1/completions`` request as soon as the last
one ended) and `LevelResult` (TTFT, TPOT, ITL and output tokens/s, as `vllm bench serve` defines them).

Invariants: every server under test gets byte-identical request bodies (``prompt`` as token ids,
``ignore_eos``, ``temperature`` 0), so it generates exactly ``output_len`` tokens; a response that
does not is an error, never a shorter sample. ITL is the gap between successive content chunks
(a chunk may carry several tokens); TPOT is ``(e2e - TTFT) / (tokens - 1)`` per request; output
tokens/s is every completed request's tokens over the level's wall time.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from loadtests.bench_common import stream_request, summarize


@dataclass(frozen=True)
class Level:
    prompt_len: int
    output_len: int
    users: int
    num_requests: int

    @property
    def name(self) -> str:
        return f"{self.prompt_len}in-{self.output_len}out-{self.users}u"


@dataclass
class Sample:
    sent: float
    chunks: list[float] = field(default_factory=list)
    tokens: int = 0
    end: float | None = None
    error: str | None = None


@dataclass(frozen=True)
class LevelResult:
    level: Level
    duration_s: float
    completed: int
    errors: list[str]
    ttft_ms: dict[str, Any]
    tpot_ms: dict[str, Any]
    itl_ms: dict[str, Any]
    output_tok_s: float
    tokens_per_chunk: float

    def as_json(self) -> dict[str, Any]:
        return {"prompt_len": self.level.prompt_len, "output_len": self.level.output_len,
                "users": self.level.users, "num_requests": self.level.num_requests,
                "duration_s": round(self.duration_s, 3), "completed": self.completed,
                "errors": self.errors[:5], "num_errors": len(self.errors),
                "ttft_ms": self.ttft_ms, "tpot_ms": self.tpot_ms, "itl_ms": self.itl_ms,
                "output_tok_s": round(self.output_tok_s, 2), "tokens_per_chunk": round(self.tokens_per_chunk, 3)}


def random_prompts(n: int, length: int, vocab_size: int, seed: int) -> list[list[int]]:
    """``n`` prompts of ``length`` token ids, away from the special tokens at both ends of the vocabulary."""
    rng = random.Random(seed)
    lo, hi = min(200, vocab_size // 4), vocab_size - 200
    return [[rng.randrange(lo, hi) for _ in range(length)] for _ in range(n)]


def request_body(model: str, prompt: Sequence[int], output_len: int) -> dict[str, Any]:
    return {"model": model, "prompt": list(prompt), "max_tokens": output_len, "ignore_eos": True,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}


async def one_request(client: httpx.AsyncClient, body: dict[str, Any]) -> Sample:
    s = Sample(sent=time.perf_counter())

    def record(chunk: dict[str, Any]) -> None:
        choices = chunk.get("choices") or []
        if choices and choices[0].get("text"):
            s.chunks.append(time.perf_counter())
        if chunk.get("usage"):
            s.tokens = int(chunk["usage"]["completion_tokens"])

    s.error = await stream_request(client, "/v1/completions", body, record)
    if s.error is not None:
        return s
    s.end = time.perf_counter()
    if s.tokens != body["max_tokens"]:
        s.error = f"{s.tokens} tokens generated, {body['max_tokens']} asked for with ignore_eos"
    elif not s.chunks:
        s.error = "no content chunk"
    return s


async def run_level(base_url: str, model: str, level: Level, prompts: Sequence[Sequence[int]],
                    timeout_s: float = 600.0, transport: httpx.AsyncBaseTransport | None = None) -> LevelResult:
    """``level.users`` closed-loop workers over ``prompts`` (taken in order) until ``num_requests`` are sent."""
    queue: asyncio.Queue[Sequence[int]] = asyncio.Queue()
    for p in prompts[: level.num_requests]:
        queue.put_nowait(p)
    samples: list[Sample] = []
    limits = httpx.Limits(max_connections=level.users + 4, max_keepalive_connections=level.users + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout_s, limits=limits, transport=transport) as client:

        async def worker() -> None:
            while not queue.empty():
                prompt = queue.get_nowait()
                samples.append(await one_request(client, request_body(model, prompt, level.output_len)))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(level.users)))
        duration = time.perf_counter() - t0
    ok = [s for s in samples if s.error is None and s.end is not None]
    ttft = [(s.chunks[0] - s.sent) * 1e3 for s in ok]
    tpot = [(s.end - s.chunks[0]) * 1e3 / (s.tokens - 1) for s in ok if s.end is not None and s.tokens > 1]
    itl = [(b - a) * 1e3 for s in ok for a, b in zip(s.chunks, s.chunks[1:], strict=False)]
    n_chunks = sum(len(s.chunks) for s in ok)
    return LevelResult(level=level, duration_s=duration, completed=len(ok),
                       errors=[s.error for s in samples if s.error is not None],
                       ttft_ms=summarize(ttft), tpot_ms=summarize(tpot), itl_ms=summarize(itl),
                       output_tok_s=sum(s.tokens for s in ok) / duration if duration > 0 else 0.0,
                       tokens_per_chunk=sum(s.tokens for s in ok) / n_chunks if n_chunks else 0.0)
