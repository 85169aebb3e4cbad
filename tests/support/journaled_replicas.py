"""Real replica classes with a journal (and optional slowness), for the kill and disconnect tests.

`journaled_prefill(log_dir, delay_s)` / `journaled_decode(log_dir, delay_s)` return subclasses of
the real `PrefillServer` / `DecodeServer`: each replica appends every request id it receives to
``<log_dir>/<role>-<pid>.log`` (flushed per line, so the file survives a SIGKILL) and may sleep
``delay_s`` before a prefill or between streamed decode events (or hold chosen requests before
decoding them, or hold every stream until the test opens a gate: a file it creates), so that a
kill reliably lands on requests in flight. Everything else is the real code path: engine, outbox,
KV source, gloo pulls.

The classes are built at run time, so cloudpickle ships them by value (the bases by reference).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from decode_worker.deployment import DecodeServer
from decode_worker.types import DecodeRequest, TokenEvent
from prefill_worker.deployment import PrefillServer
from prefill_worker.types import PrefillRequest, PrefillResult


def _journal(log_dir: str, role: str) -> Any:
    path = Path(log_dir) / f"{role}-{os.getpid()}.log"
    fh = open(path, "a", buffering=1)  # noqa: SIM115 (lives as long as the replica)
    return fh


def journaled_prefill(log_dir: str, delay_s: float = 0.0) -> type:
    """A `PrefillServer` that journals request ids and waits ``delay_s`` before each prefill."""

    class JournaledPrefill(PrefillServer):
        def __init__(self, config: Any) -> None:
            super().__init__(config)
            self._journal = _journal(log_dir, "prefill")

        async def prefill(self, req: PrefillRequest) -> PrefillResult:
            self._journal.write(f"{req.request_id}\n")
            if delay_s:
                await asyncio.sleep(delay_s)
            return await super().prefill(req)

    return JournaledPrefill


def journaled_decode(log_dir: str, delay_s: float = 0.0, hold_seed: int | None = None,
                     hold_s: float = 0.0, gate: str | None = None) -> type:
    """A `DecodeServer` that journals request ids and waits ``delay_s`` after each streamed event.

    A request whose sampling seed is ``hold_seed`` waits ``hold_s`` before the worker sees it, as if
    it queued behind a full batch: its KV stays in the prefill replica's outbox meanwhile. With a
    ``gate`` (a path), every request waits before the worker sees it until that file exists.
    """

    class JournaledDecode(DecodeServer):
        def __init__(self, config: Any) -> None:
            super().__init__(config)
            self._journal = _journal(log_dir, "decode")

        async def generate(self, req: DecodeRequest) -> AsyncIterator[TokenEvent]:
            self._journal.write(f"{req.request_id}\n")
            while gate is not None and not Path(gate).exists():
                await asyncio.sleep(0.02)
            if hold_seed is not None and req.sampling.seed == hold_seed:
                await asyncio.sleep(hold_s)
            async for ev in super().generate(req):
                yield ev
                if delay_s:
                    await asyncio.sleep(delay_s)

    return JournaledDecode


def read_journals(log_dir: str | Path, role: str) -> dict[int, list[str]]:
    """``{pid: [request ids]}`` of every replica of ``role`` that ever ran."""
    out: dict[int, list[str]] = {}
    for path in Path(log_dir).glob(f"{role}-*.log"):
        pid = int(path.stem.split("-")[1])
        out[pid] = [ln for ln in path.read_text().splitlines() if ln]
    return out
