"""`KVSource`: the prefill worker's KV server: outbox leases, authenticated control channel, data plane.

Owns the listener and its life (start, stop), offering blocks (a handle under a lease), lease
expiry, the connection limit and the counters; what happens on one connection is
`kv_transfer.source_conn.SourceConnection`.

Life cycle of a transfer on the source:

    prefill done ─▶ offer(id, blocks, n_tokens) ─▶ Outbox PENDING (lease) ─▶ KVHandle to the router
    decode connects ─▶ CHALLENGE / HELLO / WELCOME (auth.py) ─▶ a pair (this connection)
    PAIR ─▶ transport.offer (may refuse) ─▶ PAIR_READY{offer} ─▶ open (worker thread, bounded by
         ``pair_timeout_s``): the data-plane pair, once per connection, before any transfer
    PULL ─▶ layout + transport + pair checks ─▶ take_for_transfer (IN FLIGHT) ─▶ PULL_READY
         ─▶ send the ceil(n_tokens / block_size) blocks (worker thread, bounded): gathered chunk
            by chunk into staging slots while the wire runs (streams.py), or, for direct
            transports (in-process only), gathered at once (run to completion) then sent
         ─▶ DONE ─▶ outbox.done (blocks freed) ─▶ ACK
    any failure after take ─▶ outbox.requeue (back under its lease) and the pair is torn down
    RELEASE ─▶ outbox.release ─▶ ACK;  lease runs out ─▶ the expiry task frees the blocks

Invariants: the event loop never blocks (gather/send/open/close run in a dedicated executor);
transfers on one pair are serialized (one connection = one pair, its handler is sequential and
holds the pair's lock); different pairs run concurrently; a connection and its pair live until the
peer closes it or dies (TCP keepalive), or a failure ends them: never torn down for idling; the
staging memory of all pairs together stays within ``max_inflight_bytes`` (`StagingPool`); a peer
that is slow, silent, garbage or unauthenticated costs at most its timeouts (and, before it
authenticates, a frame of at most `MAX_HELLO_BYTES`) and never affects other pairs; every refusal
is an ``Error`` frame with a reason; blocks are read only while their entry is in flight (the stream is
cancelled, or the gather ran to completion, before a failed entry is requeued); the control
connection is read during the data plane, so a destination that dies fails the transfer at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass

from engine.kv_cache import KVCache
from kv_transfer.auth import DEFAULT_MAX_SKEW_S, check_secret
from kv_transfer.blocking import make_executor
from kv_transfer.handle import KVHandle
from kv_transfer.layout import KVLayout
from kv_transfer.node import default_node_id, node_ip
from kv_transfer.outbox import Outbox, OutboxStats
from kv_transfer.source_conn import MAX_HELLO_BYTES, SourceConnection, SourceContext, SourceCounts
from kv_transfer.staging import StagingPool
from kv_transfer.streams import min_inflight_bytes
from kv_transfer.transport import check_transport_available

__all__ = ["MAX_HELLO_BYTES", "KVSource", "SourceConfig", "SourceStats"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SourceConfig:
    host: str | None = None  # control + data plane address; None: node_ip(). "0.0.0.0" only if set here
    port: int = 0  # 0: a free port (see KVSource.address)
    transport: str = "gloo"
    node_id: str | None = None
    expire_interval_s: float = 1.0
    handshake_timeout_s: float = 10.0  # connect → WELCOME
    io_timeout_s: float = 30.0  # one reply inside an exchange
    idle_timeout_s: float | None = None  # between exchanges; None: a pair lives until its peer dies
    pair_timeout_s: float = 60.0  # setting up the data-plane pair (PAIR)
    transfer_timeout_s: float = 60.0  # one send, and the wait for DONE
    max_connections: int = 256
    max_threads: int = 8
    max_inflight_bytes: int = 64 << 20  # staging buffers of all transfers (StagingPool), lent + idle
    max_clock_skew_s: float = DEFAULT_MAX_SKEW_S


@dataclass(frozen=True)
class SourceStats:
    host: str
    port: int
    connections: int
    transfers: int
    bytes_sent: int
    seconds_sending: float
    refused: int
    failed: int
    auth_failures: int
    outbox: OutboxStats
    pairs: int = 0  # data-plane pairs set up (PAIR) since start
    staging_peak_bytes: int = 0  # most staging memory held at once (at most max_inflight_bytes)


class KVSource:
    """Serves the outbox's transfers to authenticated pullers; see the module docstring."""

    def __init__(self, cache: KVCache, outbox: Outbox, secret: bytes, layout: KVLayout,
                 config: SourceConfig | None = None) -> None:
        self.config = config = config or SourceConfig()
        layout.check_cache(cache)
        check_transport_available(config.transport)  # fails here, at startup, not at the first pull
        self.cache, self.outbox, self.layout = cache, outbox, layout
        self._secret = check_secret(secret)
        self.host = config.host or node_ip()
        self.node_id = config.node_id or default_node_id("prefill")
        self._server: asyncio.Server | None = None
        self._expirer: asyncio.Task[None] | None = None
        self._conns: set[SourceConnection] = set()
        self._tasks: set[asyncio.Task[object]] = set()
        self._executor = make_executor("kv-source", config.max_threads)  # replaced by each start()
        if config.max_inflight_bytes < min_inflight_bytes():
            raise ValueError(f"max_inflight_bytes={config.max_inflight_bytes} is below the "
                             f"{min_inflight_bytes()} bytes of one staging chunk")
        self._pool = StagingPool(config.max_inflight_bytes)
        self._port = 0
        self._counts = SourceCounts()
        self._context = self._make_context()

    def _make_context(self) -> SourceContext:
        return SourceContext(self.config, self.host, self.node_id, self._secret, self.cache, self.layout,
                             self.outbox, self._executor, self._pool, self._counts)

    # --- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        if self._server is not None:
            return
        self._executor = make_executor("kv-source", self.config.max_threads)
        self._context = self._make_context()
        self._server = await asyncio.start_server(self._on_connect, self.host, self.config.port,
                                                  reuse_address=True)
        self._port = self._server.sockets[0].getsockname()[1]
        self._expirer = asyncio.create_task(self._expire_loop(), name="kv-source-expiry")
        log.info("KV source %s listening on %s:%d (%s)", self.node_id, self.host, self._port,
                 self.config.transport)

    async def stop(self, release_pending: bool = True) -> None:
        """Stop serving: close the listener and every pair; optionally free the outbox's pending blocks."""
        if self._server is not None:
            self._server.close()
        if self._expirer is not None:
            self._expirer.cancel()
        for t in list(self._tasks):
            t.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=self.config.transfer_timeout_s)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5.0)
        self._server = None
        if release_pending:
            self.outbox.release_all()
        self._executor.shutdown(wait=False, cancel_futures=True)

    @property
    def listening(self) -> bool:
        return self._server is not None

    @property
    def address(self) -> tuple[str, int]:
        if self._server is None:
            raise RuntimeError("KVSource is not started")
        return (self.host, self._port)

    def offer(self, transfer_id: str | None, block_ids: list[int], n_tokens: int,
              lease_s: float | None = None) -> KVHandle:
        """Put a finished prompt's blocks in the outbox and return the handle a puller needs."""
        host, port = self.address
        need = self.layout.blocks_for_tokens(n_tokens)
        if len(block_ids) < need:
            raise ValueError(f"{n_tokens} tokens need {need} blocks of {self.layout.block_size}, "
                             f"got {len(block_ids)}")
        bad = [b for b in block_ids if not 0 <= b < self.cache.num_blocks]
        if bad:
            raise ValueError(f"block ids out of range 0..{self.cache.num_blocks - 1}: {bad[:5]}")
        lease = self.outbox.default_lease_s if lease_s is None else lease_s
        # Build the handle first: it validates the id before anything is held.
        handle = KVHandle(transfer_id or uuid.uuid4().hex, host, port, n_tokens, self.layout,
                          time.time() + lease)
        self.outbox.put(handle.transfer_id, block_ids, n_tokens, lease_s=lease)
        return handle

    def stats(self) -> SourceStats:
        n = self._counts
        return SourceStats(host=self.host, port=self._port, connections=len(self._conns),
                           transfers=n.transfers, bytes_sent=n.bytes_sent, seconds_sending=n.seconds_sending,
                           refused=n.refused, failed=n.failed, auth_failures=n.auth_failures,
                           outbox=self.outbox.stats(), pairs=n.pairs, staging_peak_bytes=self._pool.peak_bytes)

    async def _expire_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.expire_interval_s)
            try:
                expired = self.outbox.expire()
            except Exception:  # a failing free_fn must not stop future expiry
                log.exception("KV source: expiring leases failed")
                continue
            if expired:
                log.info("KV source: %d lease(s) expired: %s", len(expired), expired[:5])

    async def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            await SourceConnection(self._context, reader, writer).serve(self._conns)
        finally:
            self._tasks.discard(task)
