"""`KVPuller`: the decode worker's side: pull a handle's KV blocks into reserved blocks of its cache.

Life cycle of a pull (the decode scheduler reserved ``dst_block_ids`` first):

    pull(handle, cache, block_ids)
      ─▶ local checks (layout, block ids)            ─▶ TransferRefused / ValueError, nothing sent
      ─▶ per-source lock (one transfer at a time per pair; other sources run concurrently)
      ─▶ cached connection, or connect + CHALLENGE / HELLO / WELCOME
      ─▶ PULL ─▶ PULL_READY | ERROR{refused} (→ TransferRefused, the connection stays)
      ─▶ open the pair if new; receive (worker thread, bounded): layer by layer through a small
         ring, scattered into the blocks while the next layers arrive (streams.py), or straight
         into the blocks (direct transports)
      ─▶ DONE ─▶ ACK (the source has freed its copy) ─▶ PullStats

Invariants: everything happens within ``timeout_s`` or raises `TransferTimeout`; the event loop
never blocks (receive, scatter, open and close run in a dedicated executor); any failure other
than a refusal tears down that source's connection and pair (rebuilt by the next pull), so a dead
or silent source leaves nothing hanging and never affects pulls from other sources; a cancelled
pull never writes the blocks after it returns (the scatter stream is cancelled; direct transports
are aborted); the destination's blocks hold valid data only if `pull` returned.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass

from engine.kv_cache import KVCache
from kv_transfer.auth import check_secret, make_hello, verify_welcome
from kv_transfer.blocking import make_executor, run_bounded
from kv_transfer.blocks import direct_views, run_lengths
from kv_transfer.config import KVTransferConfig
from kv_transfer.dataplane import open_and_recv, open_and_recv_stream
from kv_transfer.errors import AuthError, ConnectionClosed, TransferError, TransferRefused, TransferTimeout
from kv_transfer.framing import recv_message, send_message
from kv_transfer.handle import KVHandle
from kv_transfer.layout import KVLayout
from kv_transfer.messages import Ack, Challenge, Done, Error, Message, Pull, PullReady, Release, Welcome
from kv_transfer.node import default_node_id, node_ip
from kv_transfer.streams import BufferPool, ScatterStream
from kv_transfer.transport import DEST_RANK, KVTransport, check_transport_available, make_transport

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PullerConfig:
    host: str | None = None  # this node's data-plane address (gloo binds here); None: node_ip()
    transport: str = "gloo"
    node_id: str | None = None
    connect_timeout_s: float = 10.0
    close_timeout_s: float = 10.0
    pair_timeout_s: float = 60.0  # ceiling for a pair's own waits; each pull's deadline is tighter
    max_threads: int = 8
    buffer_pool_bytes: int = 64 << 20  # reusable ring buffers of the layer streams


@dataclass(frozen=True)
class PullStats:
    transfer_id: str
    nbytes: int
    seconds: float  # PULL_READY → data in the blocks (data plane + scatter; not connect/queueing)
    n_blocks: int

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


@dataclass
class _Conn:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    server_id: str
    transport: KVTransport | None = None

    def healthy(self) -> bool:
        return not self.writer.is_closing() and not self.reader.at_eof()


class KVPuller:
    """Pulls KV from `KVSource`s into this process's cache; one per decode worker."""

    def __init__(self, secret: bytes, layout: KVLayout, config: PullerConfig | None = None) -> None:
        self.config = config = config or PullerConfig()
        check_transport_available(config.transport)  # fails at startup, not at the first pull
        self._secret = check_secret(secret)
        self.layout = layout
        self.host = config.host or node_ip()
        self.node_id = config.node_id or default_node_id("decode")
        self._conns: dict[tuple[str, int], _Conn] = {}
        self._locks: dict[tuple[str, int], asyncio.Lock] = {}
        self._executor = make_executor("kv-puller", config.max_threads)
        self._pool = BufferPool(config.buffer_pool_bytes)
        self._closed = False

    # --- public -------------------------------------------------------------------------------

    async def pull(self, handle: KVHandle, dst_cache: KVCache, dst_block_ids: list[int],
                   timeout_s: float = KVTransferConfig.timeout_s) -> PullStats:
        """Receive ``handle``'s blocks into ``dst_block_ids`` (the first ``handle.n_blocks`` of them)."""
        handle.layout.check_compatible(self.layout)  # the source re-checks; this fails fast
        self.layout.check_cache(dst_cache)
        blocks = _check_block_ids(dst_block_ids, handle.n_blocks, dst_cache.num_blocks)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        for attempt in range(2):
            async with self._source_lock(handle.source, deadline, f"pull {handle.transfer_id}"):
                conn, reused = await self._connection(handle.source, deadline)
                try:
                    return await self._pull_on(conn, handle, dst_cache, blocks, deadline)
                except TransferRefused:
                    raise  # nothing moved; the pair is intact
                except _Stale as e:
                    await self._drop(handle.source)
                    if not reused or attempt:
                        raise TransferError(f"pull {handle.transfer_id}: {handle.source}: {e}") from None
                    log.debug("KV puller: cached connection to %s was stale, reconnecting", handle.source)
                except BaseException:
                    await self._drop(handle.source)
                    raise
        raise AssertionError("unreachable")

    async def release(self, handle: KVHandle, timeout_s: float = 10.0) -> None:
        """Tell the source to free ``handle``'s blocks without sending them (e.g. the request was aborted)."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        async with self._source_lock(handle.source, deadline, f"release {handle.transfer_id}"):
            conn, _ = await self._connection(handle.source, deadline)
            try:
                await send_message(conn.writer, Release(handle.transfer_id), timeout_s=self._left(deadline))
                reply = await self._recv(conn, deadline)
                if not isinstance(reply, Ack) or reply.transfer_id != handle.transfer_id:
                    raise TransferError(f"release {handle.transfer_id}: unexpected {reply.TYPE} reply")
            except BaseException:
                await self._drop(handle.source)
                raise

    async def close(self) -> None:
        self._closed = True
        for source in list(self._conns):
            await self._drop(source)
        self._executor.shutdown(wait=False, cancel_futures=True)

    # --- one pull on one connection -----------------------------------------------------------

    async def _pull_on(self, conn: _Conn, handle: KVHandle, cache: KVCache, blocks: list[int],
                       deadline: float) -> PullStats:
        tid, n_blocks = handle.transfer_id, len(blocks)
        fresh = conn.transport is None
        transport = conn.transport or make_transport(self.config.transport, DEST_RANK, host=self.host,
                                                     timeout_s=self.config.pair_timeout_s)
        try:
            runs = run_lengths(blocks) if transport.direct else None
            pull = Pull(tid, self.layout, n_blocks, transport.name, transport.local_info(), runs)
            try:
                await send_message(conn.writer, pull, timeout_s=self._left(deadline))
                ready = await self._recv(conn, deadline)
            except ConnectionClosed as e:
                raise _Stale(str(e)) from None
            if not isinstance(ready, PullReady):
                raise TransferError(f"pull {tid}: expected pull_ready, got {ready.TYPE}")
            _check_ready(ready, handle, n_blocks)
            if (ready.transport_info is not None) != fresh:
                raise TransferError(f"pull {tid}: source and destination disagree on whether the pair is new")
            conn.transport = transport
        except BaseException:
            if fresh:
                transport.close()  # never opened: nothing to wait for
            raise
        t0 = time.monotonic()
        left = self._left(deadline)
        stream: ScatterStream | None = None
        if transport.direct:  # straight into the blocks
            work = functools.partial(open_and_recv, transport, ready.transport_info,
                                     direct_views(cache, blocks), left)
        else:  # layer by layer through a small ring, scattering while the wire runs
            stream = ScatterStream(cache, blocks, self._pool)
            work = functools.partial(open_and_recv_stream, transport, ready.transport_info, stream, left)
        try:
            await self._recv_watching(conn, tid, run_bounded(
                self._executor, left, f"receiving {tid} from {handle.source}", work), deadline)
        except BaseException:
            if stream is not None:
                stream.cancel()  # blocks are never written after this returns (≤ one layer's copy)
            raise
        seconds = time.monotonic() - t0
        await send_message(conn.writer, Done(tid, ready.nbytes, seconds), timeout_s=self._left(deadline))
        ack = await self._recv(conn, deadline)
        if not isinstance(ack, Ack) or ack.transfer_id != tid:
            raise TransferError(f"pull {tid}: expected ack, got {ack.TYPE}")
        return PullStats(transfer_id=tid, nbytes=ready.nbytes, seconds=seconds, n_blocks=n_blocks)

    async def _recv_watching(self, conn: _Conn, tid: str, work: Awaitable[None], deadline: float) -> None:
        """Await the data-plane receive while watching the control connection.

        The source says nothing during a transfer, so anything there (EOF above all: the source
        died) means it gave up; the data plane may only notice at its timeout. Cancelling the
        watch is safe: with nothing sent, no frame is half-read.
        """
        recv = asyncio.ensure_future(work)
        watch = asyncio.ensure_future(recv_message(conn.reader, timeout_s=self._left(deadline)))
        try:
            finished, _ = await asyncio.wait({recv, watch}, return_when=asyncio.FIRST_COMPLETED)
            if recv not in finished:
                exc = watch.exception()
                what = str(exc) if exc is not None else f"an unexpected {watch.result().TYPE} message"
                if isinstance(exc, TransferTimeout):
                    raise exc
                raise TransferError(f"source {conn.server_id} gave up during {tid}: {what}")
            recv.result()
        finally:
            for f in (recv, watch):
                if not f.done():
                    f.cancel()

    # --- connections --------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _source_lock(self, source: tuple[str, int], deadline: float, what: str) -> AsyncIterator[None]:
        if self._closed:
            raise TransferError("KVPuller is closed")
        lock = self._locks.setdefault(source, asyncio.Lock())
        try:
            await asyncio.wait_for(lock.acquire(), self._left(deadline))
        except asyncio.TimeoutError:
            raise TransferTimeout(f"{what}: timed out queueing behind other transfers from {source}") from None
        try:
            yield
        finally:
            lock.release()

    async def _connection(self, source: tuple[str, int], deadline: float) -> tuple[_Conn, bool]:
        conn = self._conns.get(source)
        if conn is not None and conn.healthy():
            return conn, True
        if conn is not None:
            await self._drop(source)
        host, port = source
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(host, port), min(self.config.connect_timeout_s, self._left(deadline)))
        except asyncio.TimeoutError:
            raise TransferTimeout(f"connecting to KV source {host}:{port} timed out") from None
        except OSError as e:
            raise TransferError(f"cannot connect to KV source {host}:{port}: {e}") from None
        try:
            conn = await self._handshake(reader, writer, deadline)
        except BaseException:
            writer.close()
            raise
        self._conns[source] = conn
        return conn, False

    async def _handshake(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                         deadline: float) -> _Conn:
        challenge = await recv_message(reader, timeout_s=self._left(deadline))
        if isinstance(challenge, Error):
            raise _remote_error(challenge, "connect")
        if not isinstance(challenge, Challenge):
            raise AuthError(f"expected challenge, got {challenge.TYPE}")
        hello = make_hello(self._secret, self.node_id, challenge)
        await send_message(writer, hello, timeout_s=self._left(deadline))
        try:
            welcome = await recv_message(reader, timeout_s=self._left(deadline))
        except ConnectionClosed:
            raise AuthError("source closed the connection during the handshake") from None
        if isinstance(welcome, Error):
            raise _remote_error(welcome, "handshake")
        if not isinstance(welcome, Welcome):
            raise AuthError(f"expected welcome, got {welcome.TYPE}")
        verify_welcome(self._secret, welcome, hello, challenge)
        return _Conn(reader, writer, server_id=welcome.node_id)

    async def _recv(self, conn: _Conn, deadline: float) -> Message:
        msg = await recv_message(conn.reader, timeout_s=self._left(deadline))
        if isinstance(msg, Error):
            raise _remote_error(msg, f"source {conn.server_id}")
        return msg

    async def _drop(self, source: tuple[str, int]) -> None:
        conn = self._conns.pop(source, None)
        if conn is None:
            return
        conn.writer.close()
        transport, conn.transport = conn.transport, None
        if transport is not None:
            with contextlib.suppress(Exception):
                await run_bounded(self._executor, self.config.close_timeout_s, "closing a pair", transport.close)

    @staticmethod
    def _left(deadline: float) -> float:
        left = deadline - asyncio.get_running_loop().time()
        if left <= 0:
            raise TransferTimeout("deadline passed")
        return left


class _Stale(TransferError):
    """A cached connection turned out closed before the source answered: safe to retry once."""


def _check_block_ids(ids: list[int], need: int, num_blocks: int) -> list[int]:
    if len(ids) < need:
        raise ValueError(f"need {need} destination blocks, got {len(ids)}")
    blocks = [int(b) for b in ids[:need]]
    if len(set(blocks)) != need:
        raise ValueError("destination block ids must be distinct")
    bad = [b for b in blocks if not 0 <= b < num_blocks]
    if bad:
        raise ValueError(f"destination block ids out of range 0..{num_blocks - 1}: {bad[:5]}")
    return blocks


def _check_ready(ready: PullReady, handle: KVHandle, n_blocks: int) -> None:
    expect = (handle.transfer_id, handle.n_tokens, n_blocks, handle.nbytes)
    got = (ready.transfer_id, ready.n_tokens, ready.n_blocks, ready.nbytes)
    if got != expect:
        raise TransferError(f"pull {handle.transfer_id}: source announced (id, tokens, blocks, bytes) = {got}, "
                            f"expected {expect}")


def _remote_error(err: Error, what: str) -> TransferError:
    if err.code == "refused":
        return TransferRefused(err.reason)
    if err.code == "auth":
        return AuthError(f"{what}: source refused authentication: {err.reason}")
    return TransferError(f"{what}: source error {err.code}: {err.reason}")
