"""Misbehaving replica classes for the timeout tests, with the real replicas' constructor and methods.

Built on `tests.support.pd_fakes` (deterministic token successor, fake tokenizer) plus magic words:

- `HangingPrefill`: a prompt containing ``HANG`` never gets an answer; the replica records the
  request ids whose call was cancelled (``cancelled()``);
- `StallingDecode`: a prompt containing ``STALL`` streams two tokens, then nothing, forever;
  cancelled streams are recorded too;
- `SilentSourcePrefill`: answers every prefill with a handle to a KV "source" that accepts the
  connection and never says a word (a wedged prefill replica), in the layout of the real model the
  config names, so a real `DecodeServer` takes the handle and pulls, and its pull timeout fires.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

from decode_worker.types import DecodeRequest, TokenEvent
from engine.load_report import LoadReport
from prefill_worker.types import FirstToken, PrefillRequest, PrefillResult
from tests.support.pd_fakes import FakeDecode, FakePrefill, prompt_text, successor


class HangingPrefill(FakePrefill):
    def __init__(self, config: object) -> None:
        super().__init__(config)
        self._cancelled: list[str] = []

    async def prefill(self, req: PrefillRequest) -> PrefillResult:
        if "HANG" in prompt_text(req.prompt_token_ids):
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                self._cancelled.append(req.request_id)
                raise
        return await super().prefill(req)

    async def cancelled(self) -> list[str]:
        return list(self._cancelled)


class StallingDecode(FakeDecode):
    async def generate(self, req: DecodeRequest) -> AsyncIterator[TokenEvent]:
        if "STALL" not in prompt_text(req.prompt_token_ids):
            async for ev in super().generate(req):
                yield ev
            return
        first = req.choices[0].first_token_id
        t = first if first is not None else req.prompt_token_ids[-1]
        try:
            for _ in range(2):
                t = successor(t)
                yield TokenEvent(request_id=req.request_id, token_ids=(t,))
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            self._cancelled.append(req.request_id)
            raise


class SilentSourcePrefill:
    """Token 0 at once, and a handle to a listener that never speaks (see the module docstring)."""

    def __init__(self, config: Any) -> None:
        from engine.loading.bundled import prepare_model
        from engine.model.config import ModelConfig
        from kv_transfer.layout import KVLayout

        folder = prepare_model(config.model, progress=False)
        self._layout = KVLayout.from_model(ModelConfig.from_dir(folder), config.engine.dtype,
                                           config.engine.block_size)
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)  # the kernel completes the handshakes; nobody ever reads or writes
        self._port = self._sock.getsockname()[1]

    async def prefill(self, req: PrefillRequest) -> PrefillResult:
        from kv_transfer.handle import KVHandle

        handle = KVHandle(transfer_id=req.request_id, source_host="127.0.0.1", source_port=self._port,
                          n_tokens=len(req.prompt_token_ids), layout=self._layout, expires_at=time.time() + 60)
        token0 = FirstToken(successor(req.prompt_token_ids[-1]), logprob=-0.5)
        return PrefillResult(request_id=req.request_id, choices=(token0,) * req.n, handle=handle)

    async def load(self) -> LoadReport:
        return LoadReport(replica_id="silent-prefill", role="prefill", num_waiting=0, num_running=0,
                          outstanding_tokens=0, kv_blocks_free=1, kv_blocks_total=1)

    async def ready(self) -> bool:
        return True
