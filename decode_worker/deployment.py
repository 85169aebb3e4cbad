"""`DecodeServer`: the Ray Serve replica of the decode pool (and of the colocated baseline).

Owns: building one replica from a `DecodeWorkerConfig` — engine, KV puller (disaggregated only),
`DecodeWorker` — and exposing ``generate`` (a streamed method: one `TokenEvent` per yield),
``release`` (free an unpulled handle at its source), ``load``, ``ready``, ``stats``. All serving
logic is in `decode_worker.worker`.

Invariants: ready only once the model is loaded and the step loop runs; a cancelled ``generate``
(the router closed the stream: client disconnect, stop string) aborts the request in the worker,
which frees its blocks before the next step; ``shutdown`` refuses new requests and lets running
streams finish, bounded by ``drain_timeout_s``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator
from typing import Any

import torch

from decode_worker.config import DecodeWorkerConfig
from decode_worker.importer import RemoteImporter
from decode_worker.types import DecodeRequest, TokenEvent
from decode_worker.worker import DecodeWorker
from engine.engine import Engine
from engine.errors import QueueFullError
from engine.load_report import LoadReport
from engine.tokenizer import Tokenizer
from kv_transfer.client import KVPuller, PullerConfig
from kv_transfer.config import node_address
from kv_transfer.handle import KVHandle
from kv_transfer.layout import KVLayout

log = logging.getLogger(__name__)


class DecodeServer:
    def __init__(self, config: DecodeWorkerConfig) -> None:
        if config.engine.num_threads:
            torch.set_num_threads(config.engine.num_threads)
        self.config = config
        self.engine = Engine.load(config.model, config.engine, config.model_cache_dir)
        eos = Tokenizer.from_dir(self.engine.model_dir).eos_token_ids
        importer = None
        if config.mode != "colocated":
            layout = KVLayout.from_model(self.engine.model_config, config.engine.dtype, self.engine.block_size)
            host = config.kv.host or node_address()
            puller = KVPuller(config.kv.secret.encode(), layout, PullerConfig(host=host, transport=config.kv.transport))
            importer = RemoteImporter(puller, timeout_s=config.kv.timeout_s)
        self.replica_id = f"{'colocated' if config.mode == 'colocated' else 'decode'}-{os.getpid()}"
        self.worker = DecodeWorker(self.engine, config, importer, eos, self.replica_id)
        self._started = False
        self._draining = False

    async def _ensure_started(self) -> DecodeWorker:
        if not self._started:
            self._started = True
            await self.worker.start()
        return self.worker

    async def generate(self, req: DecodeRequest) -> AsyncIterator[TokenEvent]:
        if self._draining:
            raise QueueFullError("this decode replica is draining", retry_after_s=0.5)
        worker = await self._ensure_started()
        async for ev in worker.generate(req):
            yield ev

    async def release(self, handle: KVHandle) -> bool:
        """Free a handle's blocks at its source without pulling them: its request ended before any
        decode replica took it (client gone between token 0 and the decode call, decode refused).
        Any replica will do: its puller authenticates to the source like for a pull. False in
        colocated mode (there are no handles)."""
        importer = self.worker.importer
        if importer is None:
            return False
        await importer.release(handle)
        return True

    async def load(self) -> LoadReport:
        worker = await self._ensure_started()
        rep = worker.load_report()
        return LoadReport(**{**rep.__dict__, "ready": not self._draining})

    async def ready(self) -> bool:
        await self._ensure_started()
        return not self._draining

    async def stats(self) -> dict[str, Any]:
        worker = await self._ensure_started()
        pool = self.engine.pool
        pool.check_integrity()
        return {
            "replica_id": self.replica_id,
            "pid": os.getpid(),
            "kv_blocks_total": pool.num_blocks,
            "kv_blocks_used": pool.num_used_blocks,
            "streams": len(worker.streams),
            "steps": worker.num_steps,
            "swapped_out": worker.num_swapped_out,
            "idle": worker.is_idle(),
        }

    async def shutdown(self, drain_timeout_s: float = 30.0) -> None:
        self._draining = True
        deadline = time.monotonic() + drain_timeout_s
        while self.worker.streams and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await self.worker.stop()
        if self.worker.importer is not None:
            await self.worker.importer.close()

    async def __del__(self) -> None:
        try:
            await self.shutdown()
        except Exception:
            log.exception("decode replica shutdown failed")
