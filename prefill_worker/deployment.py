"""`PrefillServer`: the Ray Serve replica of the prefill pool — a thin shell over `PrefillWorker`.

Owns: building one replica's pieces from a `PrefillWorkerConfig` (on `engine.replica.ReplicaShell`'s
engine: the outbox, the KV source that serves pulls, the worker) and exposing them to the router:
``prefill``, ``load`` (its load report carries the KV source's address: decode replicas meet it
from there, before any request), ``ready``, ``stats``. All serving logic is in `prefill_worker.worker`; all
transfer logic in `kv_transfer`.

Invariants: the replica reports ready only after the model is loaded, has run its warm-up forward
(``warmup_tokens``, by default one full ``max_batch_tokens`` batch) and the KV source listens;
``shutdown`` stops taking work, lets queued prefills finish (bounded by ``drain_timeout_s``) and
releases whatever the outbox still holds.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from engine.load_report import LoadReport
from engine.replica import ReplicaShell
from kv_transfer.config import node_address
from kv_transfer.layout import KVLayout
from kv_transfer.outbox import Outbox
from kv_transfer.server import KVSource, SourceConfig
from prefill_worker.config import PrefillWorkerConfig
from prefill_worker.types import PrefillRequest, PrefillResult
from prefill_worker.worker import PrefillWorker

log = logging.getLogger(__name__)


class PrefillServer(ReplicaShell):
    def __init__(self, config: PrefillWorkerConfig) -> None:
        super().__init__("prefill", config.model, config.engine, config.model_cache_dir)
        self.config = config
        # the largest forward once, before serving: memory reaches its plateau at start-up, not under load
        warm = config.max_batch_tokens if config.warmup_tokens is None else config.warmup_tokens
        t0 = time.perf_counter()
        if (ran := self.engine.warm_up(warm)) > 0:
            log.info("prefill warm-up: one %d-token forward in %.2f s", ran, time.perf_counter() - t0)
        self.outbox = Outbox(self.engine.pool.free, default_lease_s=config.kv.lease_s)
        layout = KVLayout.from_model(self.engine.model_config, config.engine.dtype, self.engine.block_size)
        self.source = KVSource(
            self.engine.cache,
            self.outbox,
            config.kv.secret.encode(),
            layout,
            SourceConfig(
                host=config.kv.host or node_address(),
                port=config.kv.port,
                transport=config.kv.transport,
                transfer_timeout_s=config.kv.timeout_s,
                max_inflight_bytes=config.kv.max_inflight_bytes,
            ),
        )
        self.worker: PrefillWorker | None = None
        self._start_lock: asyncio.Lock | None = None
        self.started_at = time.time()

    async def _ensure_started(self) -> PrefillWorker:
        if self.worker is not None:
            return self.worker
        if self._start_lock is None:
            self._start_lock = asyncio.Lock()
        async with self._start_lock:
            if self.worker is None:
                await self.source.start()
                worker = PrefillWorker(
                    self.engine, self.config, self.outbox, self.source.address, self.eos_token_ids,
                    self.replica_id,
                )
                await worker.start()
                self.worker = worker
        return self.worker

    async def prefill(self, req: PrefillRequest) -> PrefillResult:
        self.refuse_if_draining()
        worker = await self._ensure_started()
        return await worker.prefill(req)

    async def load(self) -> LoadReport:
        worker = await self._ensure_started()
        host, port = self.source.address if self.source.listening else ("", 0)  # stopped: no source to meet
        return self.with_readiness(worker.load_report(), outbox_pending=self.outbox.pending(),
                                   kv_host=host, kv_port=port)

    async def stats(self) -> dict[str, Any]:
        """Books for tests and dashboards: pool, outbox and source counters."""
        await self._ensure_started()
        return self.pool_stats() | {
            "outbox_pending": self.outbox.pending(),
            "outbox_blocks_held": self.outbox.num_blocks_held(),
            "source": self.source.stats().__dict__ | {"outbox": self.outbox.stats().__dict__},
        }

    async def shutdown(self, drain_timeout_s: float | None = None) -> None:
        """Graceful drain: refuse new work, finish queued prefills, let decode replicas pull what the
        outbox holds (bounded by the lease), then free whatever is left."""
        self.draining = True
        limit = self.config.kv.lease_s if drain_timeout_s is None else drain_timeout_s
        deadline = time.monotonic() + limit
        if (worker := self.worker) is not None:
            await self.wait_while(lambda: worker.waiting, deadline)
            await worker.stop()
        await self.wait_while(self.outbox.pending, deadline)  # handles already returned
        await self.source.stop(release_pending=True)
