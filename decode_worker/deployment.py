"""`DecodeServer`: the Ray Serve replica of the decode pool (and of the colocated baseline).

Owns: building one replica from a `DecodeWorkerConfig` — on `engine.replica.ReplicaShell`'s engine,
a KV puller (disaggregated only) and the `DecodeWorker` — and exposing ``generate`` (a streamed
method: one `TokenEvent` per yield), ``release`` (free an unpulled handle at its source), ``load``,
``ready``, ``stats``. All serving logic is in `decode_worker.worker`.

Meeting the prefill pool (disaggregated, with ``prefill_deployment`` set): when the replica starts
(its first ``load``/``ready``, which Serve's routing-stats poll makes at once), the puller starts
keeping the pool's KV sources (`decode_worker.prefill_pool` lists them, `kv_transfer.keeper` meets the
new, retries the failed, forgets the gone), so every pair is up before a request names its source.
The load report says how many pairs are up and how many pulls still found none.

Invariants: ready only once the model is loaded and the step loop runs; a cancelled ``generate``
(the router closed the stream: client disconnect, stop string) aborts the request in the worker,
which frees its blocks before the next step; ``shutdown`` refuses new requests and lets running
streams finish, bounded by ``drain_timeout_s``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from decode_worker.config import DecodeWorkerConfig
from decode_worker.importer import RemoteImporter
from decode_worker.prefill_pool import PrefillPoolView
from decode_worker.types import DecodeRequest, TokenEvent
from decode_worker.worker import DecodeWorker
from engine.load_report import LoadReport
from engine.replica import ReplicaShell
from kv_transfer.client import KVPuller, PullerConfig
from kv_transfer.config import node_address
from kv_transfer.handle import KVHandle
from kv_transfer.layout import KVLayout

log = logging.getLogger(__name__)

DRAIN_TIMEOUT_S = 30.0  # the longest `shutdown` waits for running streams, unless told
SOURCES_POLL_S = 1.0  # how often the prefill pool's KV sources are read (Serve refreshes them per stats period)


class DecodeServer(ReplicaShell):
    def __init__(self, config: DecodeWorkerConfig) -> None:
        super().__init__("decode", config.model, config.engine, config.model_cache_dir,
                         role="colocated" if config.mode == "colocated" else None)
        self.config = config
        importer = None
        self.puller: KVPuller | None = None
        self.prefill_pool: PrefillPoolView | None = None
        if config.mode != "colocated":
            layout = KVLayout.from_model(self.engine.model_config, config.engine.dtype, self.engine.block_size)
            host = config.kv.host or node_address()
            puller = KVPuller(config.kv.secret.encode(), layout, PullerConfig(
                host=host, transport=config.kv.transport, max_inflight_bytes=config.kv.max_inflight_bytes))
            importer = RemoteImporter(puller, timeout_s=config.kv.timeout_s)
            self.puller = puller
            if config.prefill_deployment is not None:
                self.prefill_pool = PrefillPoolView(config.prefill_deployment)
        self.worker = DecodeWorker(self.engine, config, importer, self.eos_token_ids, self.replica_id)
        self._started = False

    async def _ensure_started(self) -> DecodeWorker:
        if not self._started:
            self._started = True
            await self.worker.start()
            if self.puller is not None and self.prefill_pool is not None and self.prefill_pool.watching:
                self.puller.keep_sources(self.prefill_pool.sources, SOURCES_POLL_S)
        return self.worker

    async def generate(self, req: DecodeRequest) -> AsyncIterator[TokenEvent]:
        self.refuse_if_draining()
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
        if self.puller is None:
            return self.with_readiness(worker.load_report())
        return self.with_readiness(worker.load_report(), kv_pairs=len(self.puller.peers.sources()),
                                   kv_pulls_unpaired=self.puller.pulls_unpaired)

    async def stats(self) -> dict[str, Any]:
        worker = await self._ensure_started()
        kv = {} if self.puller is None else {
            "kv_sources": dataclasses.asdict(self.puller.pair_stats()),
            "kv_pulls_unpaired": self.puller.pulls_unpaired,
        }
        return self.pool_stats() | kv | {
            "streams": len(worker.streams),
            "steps": worker.num_steps,
            "swapped_out": worker.num_swapped_out,
            "idle": worker.is_idle(),
        }

    async def shutdown(self, drain_timeout_s: float | None = None) -> None:
        """Graceful drain: refuse new requests, let running streams finish (bounded), then stop."""
        self.draining = True
        limit = DRAIN_TIMEOUT_S if drain_timeout_s is None else drain_timeout_s
        await self.wait_while(lambda: self.worker.streams, time.monotonic() + limit)
        await self.worker.stop()
        if self.worker.importer is not None:
            await self.worker.importer.close()
