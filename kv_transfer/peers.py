"""`Peers`: the decode side's control connections and data-plane pairs, one per prefill source.

Owns meeting a source: connect, CHALLENGE / HELLO / WELCOME, PAIR / PAIR_READY, then both ends open
the pair (for nccl, the communicator's init). This is set-up work, never a transfer's: `meet` runs
it as a task of its own, bounded by ``pair_timeout_s`` and by no request's deadline.

When a decode replica meets a source: as soon as it learns the source's control address. In a
cluster that is at start-up and whenever the prefill pool changes: the keeper (`keeper.py`, fed the
pool's sources from the prefill replicas' load reports) meets every source before a request names
it, and forgets (`forget`) a source that left the pool. A source not met yet (a replica newer than
the last poll, or no keeper) is met when the first handle naming it arrives: the meeting starts in
the background while the pull waits for it within its own deadline (a pull whose deadline passes
first fails with `TransferTimeout` saying the pair is still being set up; the meeting goes on and
the next pull finds the pair).

Invariants: at most one meeting per source at a time; a connection in the table always has an open
pair; a pair lives until the peer closes the connection or dies (TCP keepalive), a failure ends it
(`drop`), or its source leaves the pool (`forget`, after the transfer on it): never torn down for
idling; every wait has a deadline; the event loop never blocks
(opening and closing a pair run in the executor).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from kv_transfer.auth import make_hello, verify_welcome
from kv_transfer.blocking import run_bounded
from kv_transfer.dataplane import open_pair
from kv_transfer.errors import AuthError, ConnectionClosed, TransferError, TransferRefused, TransferTimeout
from kv_transfer.framing import keep_alive, recv_message, send_message
from kv_transfer.messages import Challenge, Error, Message, Pair, PairReady, Welcome
from kv_transfer.transport import DEST_RANK, KVTransport, make_transport

log = logging.getLogger(__name__)

Source = tuple[str, int]


@dataclass(frozen=True)
class PeersConfig:
    host: str  # this node's data-plane address
    transport: str
    node_id: str
    connect_timeout_s: float
    pair_timeout_s: float  # a whole meeting: connect, authenticate, set up and open the pair
    close_timeout_s: float


@dataclass
class Conn:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    server_id: str
    transport: KVTransport | None = None

    def healthy(self) -> bool:
        return (not self.writer.is_closing() and not self.reader.at_eof()
                and self.transport is not None and self.transport.is_open)


class Peers:
    def __init__(self, secret: bytes, config: PeersConfig, executor: ThreadPoolExecutor) -> None:
        self._secret = secret
        self.config = config
        self._executor = executor
        self._conns: dict[Source, Conn] = {}
        self._locks: dict[Source, asyncio.Lock] = {}
        self._meetings: dict[Source, asyncio.Task[None]] = {}
        self.meetings_started = 0

    def paired(self, source: Source) -> Conn | None:
        conn = self._conns.get(source)
        return conn if conn is not None and conn.healthy() else None

    def is_meeting(self, source: Source) -> bool:
        task = self._meetings.get(source)
        return task is not None and not task.done()

    def sources(self) -> list[Source]:
        """The sources with a healthy pair now."""
        return [s for s in self._conns if self.paired(s) is not None]

    def meeting(self, source: Source) -> asyncio.Task[None]:
        """The meeting with ``source``: the one under way or done, or a new one if none holds a pair."""
        task = self._meetings.get(source)
        if task is not None and (not task.done() or self.paired(source) is not None):
            return task
        self.meetings_started += 1
        task = asyncio.create_task(self._meet(source), name=f"kv-meet-{source[0]}:{source[1]}")
        task.add_done_callback(_log_outcome)
        self._meetings[source] = task
        return task

    async def wait_paired(self, source: Source, left_s: float, what: str) -> None:
        """Wait (at most ``left_s``) for the meeting with ``source``; its failure is raised here."""
        task = self.meeting(source)
        try:
            await asyncio.wait_for(asyncio.shield(task), left_s)
        except asyncio.TimeoutError:
            raise TransferTimeout(f"{what}: the {self.config.transport} pair with {source[0]}:{source[1]} is "
                                  "still being set up (it goes on; a later pull will find it)") from None

    @contextlib.asynccontextmanager
    async def lock(self, source: Source, left_s: float, what: str) -> AsyncIterator[None]:
        lock = self._locks.setdefault(source, asyncio.Lock())
        try:
            await asyncio.wait_for(lock.acquire(), left_s)
        except asyncio.TimeoutError:
            raise TransferTimeout(f"{what}: timed out queueing behind other transfers from {source}") from None
        try:
            yield
        finally:
            lock.release()

    async def _meet(self, source: Source) -> None:
        cfg = self.config
        loop = asyncio.get_running_loop()
        deadline = loop.time() + cfg.pair_timeout_s
        async with self.lock(source, cfg.pair_timeout_s, f"meeting {source}"):
            if self.paired(source) is not None:
                return
            await self.drop(source)
            conn = await self.connect(source, deadline)
            transport = make_transport(cfg.transport, DEST_RANK, host=cfg.host, timeout_s=cfg.pair_timeout_s)
            try:
                await send_message(conn.writer, Pair(transport.name, transport.local_info()), timeout_s=_left(deadline))
                ready = await self.recv(conn, deadline)
                if not isinstance(ready, PairReady):
                    raise TransferError(f"meeting {source}: expected pair_ready, got {ready.TYPE}")
                await run_bounded(self._executor, _left(deadline), f"opening the pair with {source}",
                                  open_pair, transport, ready.transport_info, _left(deadline))
            except BaseException:
                conn.writer.close()
                with contextlib.suppress(Exception):
                    await run_bounded(self._executor, cfg.close_timeout_s, "closing a pair", transport.close)
                raise
            conn.transport = transport
            self._conns[source] = conn
        log.info("KV puller: %s pair with %s (%s) is open", cfg.transport, source, conn.server_id)

    async def connect(self, source: Source, deadline: float) -> Conn:
        """A new authenticated control connection (no pair yet); the caller owns it."""
        host, port = source
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(host, port), min(self.config.connect_timeout_s, _left(deadline)))
        except asyncio.TimeoutError:
            raise TransferTimeout(f"connecting to KV source {host}:{port} timed out") from None
        except OSError as e:
            raise TransferError(f"cannot connect to KV source {host}:{port}: {e}") from None
        try:
            keep_alive(writer)
            return await self._handshake(reader, writer, deadline)
        except BaseException:
            writer.close()
            raise

    async def _handshake(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, deadline: float) -> Conn:
        challenge = await recv_message(reader, timeout_s=_left(deadline))
        if isinstance(challenge, Error):
            raise remote_error(challenge, "connect")
        if not isinstance(challenge, Challenge):
            raise AuthError(f"expected challenge, got {challenge.TYPE}")
        hello = make_hello(self._secret, self.config.node_id, challenge)
        await send_message(writer, hello, timeout_s=_left(deadline))
        try:
            welcome = await recv_message(reader, timeout_s=_left(deadline))
        except ConnectionClosed:
            raise AuthError("source closed the connection during the handshake") from None
        if isinstance(welcome, Error):
            raise remote_error(welcome, "handshake")
        if not isinstance(welcome, Welcome):
            raise AuthError(f"expected welcome, got {welcome.TYPE}")
        verify_welcome(self._secret, welcome, hello, challenge)
        return Conn(reader, writer, server_id=welcome.node_id)

    async def recv(self, conn: Conn, deadline: float) -> Message:
        msg = await recv_message(conn.reader, timeout_s=_left(deadline))
        if isinstance(msg, Error):
            raise remote_error(msg, f"source {conn.server_id}")
        return msg

    async def drop(self, source: Source) -> None:
        """End the connection and pair with ``source`` (after a failure, or at close)."""
        conn = self._conns.pop(source, None)
        if conn is None:
            return
        conn.writer.close()
        transport, conn.transport = conn.transport, None
        if transport is not None:
            with contextlib.suppress(Exception):
                await run_bounded(self._executor, self.config.close_timeout_s, "closing a pair", transport.close)

    async def forget(self, source: Source) -> None:
        """Close the pair with a source that left the pool: after the transfer on it (bounded), if any."""
        task = self._meetings.pop(source, None)
        if task is not None and not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        lock = self._locks.get(source)
        try:
            if lock is not None:
                await asyncio.wait_for(lock.acquire(), self.config.pair_timeout_s)
        except asyncio.TimeoutError:
            lock = None  # a transfer outlived its own deadline: close under it
        try:
            await self.drop(source)
        finally:
            if lock is not None:
                lock.release()
        log.info("KV puller: forgot %s (it left the prefill pool)", source)

    async def close(self) -> None:
        meetings = list(self._meetings.values())
        for task in meetings:
            task.cancel()
        await asyncio.gather(*meetings, return_exceptions=True)  # their clean-up runs now, not later
        for source in list(self._conns):
            await self.drop(source)


def remote_error(err: Error, what: str) -> TransferError:
    if err.code == "refused":
        return TransferRefused(err.reason)
    if err.code == "auth":
        return AuthError(f"{what}: source refused authentication: {err.reason}")
    return TransferError(f"{what}: source error {err.code}: {err.reason}")


def _left(deadline: float) -> float:
    left = deadline - asyncio.get_running_loop().time()
    if left <= 0:
        raise TransferTimeout("deadline passed")
    return left


def _log_outcome(task: asyncio.Task[None]) -> None:
    if task.cancelled():
        return
    exc = task.exception()  # retrieved here, so an unawaited failed meeting is logged once, not warned about
    if exc is not None:
        log.warning("KV puller: meeting a source failed: %s", exc)
