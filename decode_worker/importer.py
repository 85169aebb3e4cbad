"""How a decode worker gets a sequence's prompt KV into its reserved blocks.

Owns: the `KVImporter` protocol the decode worker depends on, and `InProcessImporter`, which
copies straight out of a prefill worker's outbox in the same process (tests, single-process runs).
`RemoteImporter` pulls over the network through `kv_transfer.KVPuller` (gloo or NCCL).

Invariants: ``pull`` either fills exactly the blocks covering ``handle.n_tokens`` and tells the
source it is DONE (the source frees its blocks), or raises and leaves the source able to free them
(RELEASE or lease expiry); it never writes outside ``block_ids``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

from engine.engine import Engine
from engine.kv_cache import KVCache
from kv_transfer.client import KVPuller
from kv_transfer.errors import TransferRefused
from kv_transfer.handle import KVHandle
from kv_transfer.layout import KVLayout
from kv_transfer.outbox import Outbox


@dataclass(frozen=True)
class ImportStats:
    bytes: int
    seconds: float


class KVImporter(Protocol):
    async def pull(self, handle: KVHandle, cache: KVCache, block_ids: list[int]) -> ImportStats: ...

    async def release(self, handle: KVHandle) -> None: ...

    async def close(self) -> None: ...


class LocalSource(Protocol):
    """What the in-process importer reads from a prefill worker in this process (a
    `prefill_worker.PrefillWorker` is one): its advertised address, KV layout, outbox and engine."""

    source: tuple[str, int]
    layout: KVLayout
    outbox: Outbox
    engine: Engine


class InProcessImporter:
    """Copies from prefill workers living in this process, found by their advertised address."""

    def __init__(self) -> None:
        self.sources: dict[tuple[str, int], LocalSource] = {}

    def register(self, worker: LocalSource) -> None:
        self.sources[worker.source] = worker

    def _source(self, handle: KVHandle) -> LocalSource:
        src = self.sources.get((handle.source_host, handle.source_port))
        if src is None:
            raise TransferRefused(f"unknown KV source {handle.source_host}:{handle.source_port}")
        return src

    async def pull(self, handle: KVHandle, cache: KVCache, block_ids: list[int]) -> ImportStats:
        t0 = time.perf_counter()
        src = self._source(handle)
        src.layout.check_compatible(handle.layout)
        n_blocks = (handle.n_tokens + handle.layout.block_size - 1) // handle.layout.block_size
        if len(block_ids) < n_blocks:
            raise TransferRefused(f"destination reserved {len(block_ids)} blocks, the KV needs {n_blocks}")
        entry = src.outbox.take_for_transfer(handle.transfer_id)
        try:
            data = src.engine.cache.gather_blocks(list(entry.block_ids[:n_blocks]))
            cache.scatter_blocks(block_ids[:n_blocks], data)
        except BaseException:
            src.outbox.requeue(handle.transfer_id)  # no longer in flight: release can free it now
            src.outbox.release(handle.transfer_id)
            raise
        src.outbox.done(handle.transfer_id)
        return ImportStats(bytes=data.numel() * data.element_size(), seconds=time.perf_counter() - t0)

    async def release(self, handle: KVHandle) -> None:
        src = self.sources.get((handle.source_host, handle.source_port))
        if src is not None:
            src.outbox.release(handle.transfer_id)

    async def close(self) -> None:
        self.sources.clear()


class RemoteImporter:
    """Pulls over the network from prefill replicas' `kv_transfer.KVSource`s (gloo or NCCL)."""

    def __init__(self, puller: KVPuller, timeout_s: float) -> None:
        self.puller = puller
        self.timeout_s = timeout_s

    async def meet(self, source: tuple[str, int]) -> None:
        """Set up the data-plane pair with a prefill replica's KV source now (start-up), not at its first pull."""
        await self.puller.meet(source)

    async def pull(self, handle: KVHandle, cache: KVCache, block_ids: list[int]) -> ImportStats:
        stats = await self.puller.pull(handle, cache, block_ids, timeout_s=self.timeout_s)
        return ImportStats(bytes=stats.nbytes, seconds=stats.seconds)

    async def release(self, handle: KVHandle) -> None:
        await self.puller.release(handle, timeout_s=min(self.timeout_s, 10.0))

    async def close(self) -> None:
        await self.puller.close()
