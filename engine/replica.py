"""`ReplicaShell`: what every pool's Serve replica (prefill, decode, colocated) has around its worker.

Owns: loading the replica's engine (torch threads first, then `Engine.load`) and the model's EOS
ids; the replica id; the draining flag and what follows from it (new work refused with a retry hint,
``ready`` false, the load report's ``ready`` false); the block books in ``stats``; the bounded wait
of a graceful ``shutdown``; and the async ``__del__`` Serve awaits when it stops a replica. Each
pool's deployment adds its worker, its KV endpoint and the methods the router calls.

Invariants: a draining replica takes no new work and stays draining; ``__del__`` never raises (a
failed shutdown is logged).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from engine.config import EngineConfig
from engine.engine import Engine
from engine.errors import QueueFullError
from engine.load_report import LoadReport
from engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)

_POLL_S = 0.05  # how often a draining replica looks whether its work is done


class ReplicaShell:
    """Base of a pool's replica class: subclasses define ``_ensure_started`` and ``shutdown``."""

    def __init__(self, pool: str, model: str, engine_config: EngineConfig, model_cache_dir: str | None,
                 role: str | None = None) -> None:
        if engine_config.num_threads:
            torch.set_num_threads(engine_config.num_threads)
        self.pool = pool  # "prefill" | "decode": names the replica in refusals and logs
        self.engine = Engine.load(model, engine_config, model_cache_dir)
        self.eos_token_ids = Tokenizer.from_dir(self.engine.model_dir).eos_token_ids
        self.replica_id = f"{role or pool}-{os.getpid()}"
        self.draining = False

    async def _ensure_started(self) -> object:
        """Start the worker on first use (on the replica's event loop) and return it."""
        raise NotImplementedError

    async def shutdown(self, drain_timeout_s: float | None = None) -> None:
        raise NotImplementedError

    async def ready(self) -> bool:
        await self._ensure_started()
        return not self.draining

    def refuse_if_draining(self) -> None:
        if self.draining:
            raise QueueFullError(f"this {self.pool} replica is draining", retry_after_s=0.5)

    def with_readiness(self, report: LoadReport, **extra: Any) -> LoadReport:
        """The worker's report as the router sees this replica: not ready while draining."""
        return dataclasses.replace(report, ready=not self.draining, **extra)

    def pool_stats(self) -> dict[str, Any]:
        """The head of ``stats``: who this is and its block books (checked for integrity first)."""
        pool = self.engine.pool
        pool.check_integrity()
        return {
            "replica_id": self.replica_id,
            "pid": os.getpid(),
            "kv_blocks_total": pool.num_blocks,
            "kv_blocks_used": pool.num_used_blocks,
        }

    @staticmethod
    async def wait_while(busy: Callable[[], object], deadline: float) -> None:
        """Poll until ``busy()`` is falsy or the monotonic ``deadline`` passes."""
        while busy() and time.monotonic() < deadline:
            await asyncio.sleep(_POLL_S)

    async def __del__(self) -> None:  # Serve awaits an async __del__ when it stops a replica
        try:
            await self.shutdown()
        except Exception:
            log.exception("%s replica shutdown failed", self.pool)
