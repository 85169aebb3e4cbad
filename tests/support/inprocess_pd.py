"""Prefill and decode workers in one process over a tiny model, and the reference they must match.

Owns: `make_pd` (a `PrefillWorker` and a `DecodeWorker` joined by an `InProcessImporter`, each with its
own engine, the decode worker optionally prefilling handle-less requests itself; `PD.running` starts
both and stops them after, `PD.run` is one request through both, `PD.run_choices` one request of ``n``
choices), `decode_choices` (the choices a prefill result hands on to decode), `make_colocated` (a decode
worker that prefills too), `reference` (the reference `generate()` every output is compared with),
`random_prompt`, `workload` (staggered arrivals of random prompts), `collect` (a decode stream's tokens,
finish reason and error), `collect_choices` (the same per choice index), `run_both_modes` (one batch of
requests disaggregated, then colocated) and `wait_until`. The model and the reference engine are the session fixtures
``tiny_path`` / ``ref_engine`` of ``tests/conftest.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from decode_worker.config import DecodeWorkerConfig
from decode_worker.importer import InProcessImporter
from decode_worker.types import DecodeChoice, DecodeRequest, TokenEvent
from decode_worker.worker import DecodeWorker
from engine.config import EngineConfig
from engine.engine import Engine
from engine.generate import generate
from engine.sampling.sampler import SamplingParams
from kv_transfer.config import KVTransferConfig
from kv_transfer.outbox import Outbox
from prefill_worker.config import PrefillWorkerConfig
from prefill_worker.types import PrefillRequest, PrefillResult
from prefill_worker.worker import PrefillWorker

#: the tiny model's EOS id (`tests.support.models.make_tiny`)
EOS = 2


def reference(eng: Engine, prompt: Sequence[int], params: SamplingParams) -> list[int]:
    return generate(eng, prompt, params, eos_token_ids=(EOS,)).token_ids


def random_prompt(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(3, 256) for _ in range(n))


@dataclass
class PD:
    prefill: PrefillWorker
    decode: DecodeWorker
    outbox: Outbox

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[PD]:
        """Both workers started for the block, stopped after it (decode first), whatever it raises."""
        await self.prefill.start()
        await self.decode.start()
        try:
            yield self
        finally:
            await self.decode.stop()
            await self.prefill.stop()

    async def run(self, req_id: str, prompt: Sequence[int], params: SamplingParams) -> tuple[list[int], str]:
        res = await self.prefill.prefill(PrefillRequest(req_id, tuple(prompt), params))
        (first,) = res.choices
        tokens = [first.token_id]
        if res.finished:
            assert res.handle is None
            return tokens, str(first.finish_reason)
        assert res.handle is not None
        reason = ""
        req = DecodeRequest(req_id, tuple(prompt), params, choices=decode_choices(res), handle=res.handle)
        async for ev in self.decode.generate(req):
            tokens.extend(ev.token_ids)
            reason = ev.finish_reason or reason
        return tokens, reason


    async def run_choices(self, req_id: str, prompt: Sequence[int], params: SamplingParams, n: int
                          ) -> tuple[dict[int, list[int]], dict[int, str]]:
        """One prefill of ``n`` choices, then one decode call for those token 0 did not end."""
        res = await self.prefill.prefill(PrefillRequest(req_id, tuple(prompt), params, n=n))
        firsts = res.choices
        assert len(firsts) == n
        tokens = {i: [ft.token_id] for i, ft in enumerate(firsts)}
        reasons = {i: ft.finish_reason for i, ft in enumerate(firsts) if ft.finish_reason is not None}
        if res.finished:
            assert res.handle is None and len(reasons) == n
            return tokens, reasons
        req = DecodeRequest(req_id, tuple(prompt), params, handle=res.handle, choices=decode_choices(res))
        async for ev in self.decode.generate(req):
            _add(tokens, reasons, ev)
        return tokens, reasons


def decode_choices(res: PrefillResult) -> tuple[DecodeChoice, ...]:
    """The choices of ``res`` that token 0 did not end, each with its token 0 (what the router sends on)."""
    return tuple(DecodeChoice(i, ft.token_id) for i, ft in enumerate(res.choices) if ft.finish_reason is None)


def _add(tokens: dict[int, list[int]], reasons: dict[int, str], ev: TokenEvent) -> None:
    assert ev.index not in reasons, f"choice {ev.index} has an event after its end"
    tokens.setdefault(ev.index, []).extend(ev.token_ids)
    if ev.finish_reason is not None:
        reasons[ev.index] = ev.finish_reason


async def collect_choices(worker: DecodeWorker, req: DecodeRequest) -> tuple[dict[int, list[int]], dict[int, str]]:
    """Each choice's tokens and finish reason, by index, from one decode stream."""
    tokens: dict[int, list[int]] = {}
    reasons: dict[int, str] = {}
    async for ev in worker.generate(req):
        _add(tokens, reasons, ev)
    return tokens, reasons


def workload(seed: int, n: int = 24) -> list[tuple[float, tuple[int, ...], int]]:
    rng = random.Random(seed)
    return [
        (rng.uniform(0, 0.6), random_prompt(rng, rng.randint(5, 600)), rng.randint(1, 64)) for _ in range(n)
    ]


def make_pd(
    path: Path,
    prefill_blocks: int = 256,
    decode_blocks: int = 256,
    max_batch_tokens: int = 256,
    max_num_seqs: int = 64,
    lease_s: float = 30.0,
    max_chunk_tokens: int | None = 512,
    stream_interval: int = 1,
    local_prefill: bool = False,
    local_chunk: int = 0,
) -> PD:
    """``local_prefill``: the decode worker also prefills requests without a handle (the router's LOCAL
    path), ``local_chunk`` tokens a step (0: whole)."""
    pe = Engine.from_dir(path, EngineConfig(num_blocks=prefill_blocks, block_size=16))
    de = Engine.from_dir(
        path,
        EngineConfig(num_blocks=decode_blocks, block_size=16, max_num_seqs=max_num_seqs, enable_prefix_cache=False),
    )
    outbox = Outbox(pe.pool.free, default_lease_s=lease_s)
    pw = PrefillWorker(
        pe, PrefillWorkerConfig(max_batch_tokens=max_batch_tokens, max_chunk_tokens=max_chunk_tokens,
                                kv=KVTransferConfig(lease_s=lease_s)),
        outbox, source=("inproc", 1), eos_token_ids=(EOS,),
    )
    imp = InProcessImporter()
    imp.register(pw)
    dcfg = DecodeWorkerConfig(stream_interval=stream_interval, local_prefill=local_prefill,
                              prefill_chunk_size=local_chunk)
    dw = DecodeWorker(de, dcfg, importer=imp, eos_token_ids=(EOS,))
    return PD(pw, dw, outbox)


def make_colocated(path: Path, chunk: int, blocks: int = 256, stream_interval: int = 1) -> DecodeWorker:
    eng = Engine.from_dir(path, EngineConfig(num_blocks=blocks, block_size=16, enable_prefix_cache=False))
    cfg = DecodeWorkerConfig(mode="colocated", prefill_chunk_size=chunk, stream_interval=stream_interval)
    return DecodeWorker(eng, cfg, eos_token_ids=(EOS,))


async def collect(worker: DecodeWorker, req: DecodeRequest) -> tuple[list[int], str, str | None]:
    tokens: list[int] = []
    reason, error = "", None
    async for ev in worker.generate(req):
        tokens.extend(ev.token_ids)
        reason = ev.finish_reason or reason
        error = ev.error or error
    return tokens, reason, error


async def run_both_modes(path: Path, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams],
                         chunk: int = 32) -> tuple[list[tuple[list[int], str]], list[tuple[list[int], str]]]:
    """Every request at once through a fresh prefill + decode pair, then through a fresh colocated
    worker: each request's (tokens, finish reason) in both modes."""
    pd = make_pd(path)
    colo = make_colocated(path, chunk=chunk)
    for w in (pd.prefill, pd.decode, colo):
        await w.start()
    try:
        pairs = list(enumerate(zip(prompts, params, strict=True)))
        got = await asyncio.gather(*(pd.run(f"d{i}", p, s) for i, (p, s) in pairs))
        got_colo = await asyncio.gather(*(collect(colo, DecodeRequest(f"c{i}", tuple(p), s)) for i, (p, s) in pairs))
        return list(got), [(t, r) for t, r, _ in got_colo]
    finally:
        for w in (colo, pd.decode, pd.prefill):
            await w.stop()


async def wait_until(pred: Callable[[], bool], timeout: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not pred():
        if loop.time() > end:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)
