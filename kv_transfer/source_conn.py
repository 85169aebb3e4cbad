"""`SourceConnection`: one authenticated destination on a `KVSource` = one control connection + its pair.

Owns what the source does on one connection, in order: CHALLENGE / HELLO / WELCOME (auth.py), then
a sequential loop over PAIR (set up the data-plane pair, once), PULL (announce, send the blocks,
await DONE, ACK) and RELEASE (free unpulled blocks, ACK). The server (`kv_transfer.server`) owns the
listener, the live connections' set, lease expiry and the counters this module adds to.

Invariants: the handler is sequential and holds the pair's lock around PAIR and PULL (transfers on
a pair are serialized); before authentication a peer sends at most `MAX_HELLO_BYTES`; a refusal is
an ``Error`` frame with a reason and keeps the connection; any other failure ends it and its pair
(`_teardown`, always run); an entry taken for a transfer is requeued unless DONE arrived, only once
no block is read (stream cancelled, or the gather ran to completion); the control connection is
read during the data plane, so a destination that dies fails the transfer at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

from engine.kv_cache import KVCache
from kv_transfer.auth import make_challenge, make_welcome, verify_hello
from kv_transfer.blocking import run_bounded, run_to_completion
from kv_transfer.blocks import source_tensors
from kv_transfer.dataplane import open_pair, send_all, send_streamed
from kv_transfer.errors import AuthError, CodecError, ConnectionClosed, TransferError, TransferRefused
from kv_transfer.framing import keep_alive, recv_message, send_message
from kv_transfer.layout import KVLayout
from kv_transfer.messages import Ack, Done, Error, Hello, Message, Pair, PairReady, Pull, PullReady, Release
from kv_transfer.outbox import Outbox
from kv_transfer.staging import StagingPool
from kv_transfer.streams import GatherStream
from kv_transfer.transport import SOURCE_RANK, KVTransport, make_transport, transport_class

log = logging.getLogger(__name__)

#: Largest frame accepted before authentication (a HELLO is under 400 bytes).
MAX_HELLO_BYTES = 4096


class ConnectionSettings(Protocol):
    """The settings a connection reads (`kv_transfer.server.SourceConfig` has them)."""
    @property
    def transport(self) -> str: ...
    @property
    def max_connections(self) -> int: ...
    @property
    def handshake_timeout_s(self) -> float: ...
    @property
    def io_timeout_s(self) -> float: ...
    @property
    def idle_timeout_s(self) -> float | None: ...
    @property
    def pair_timeout_s(self) -> float: ...
    @property
    def transfer_timeout_s(self) -> float: ...
    @property
    def max_clock_skew_s(self) -> float: ...


@dataclass
class SourceCounts:
    """The source's counters since start, added to by its connections (one event loop: no lock)."""

    transfers: int = 0
    bytes_sent: int = 0
    seconds_sending: float = 0.0
    refused: int = 0
    failed: int = 0
    auth_failures: int = 0
    pairs: int = 0  # data-plane pairs set up (PAIR)


@dataclass(frozen=True)
class SourceContext:
    """What every connection of one started source shares (made by `KVSource.start`)."""

    config: ConnectionSettings
    host: str
    node_id: str
    secret: bytes
    cache: KVCache
    layout: KVLayout
    outbox: Outbox
    executor: ThreadPoolExecutor
    staging: StagingPool
    counts: SourceCounts


class SourceConnection:
    """One connected destination = one data-plane pair; identity semantics (connections live in a set)."""

    def __init__(self, ctx: SourceContext, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.ctx, self.reader, self.writer = ctx, reader, writer
        host, port = writer.get_extra_info("peername")[:2]
        self.peer = f"{host}:{port}"
        self.peer_id = ""
        self.transport: KVTransport | None = None
        self.lock = asyncio.Lock()

    async def serve(self, live: set[SourceConnection]) -> None:
        """Run this connection to its end, counted in ``live`` while it serves (refused when full)."""
        peer = self.peer
        try:
            if len(live) >= self.ctx.config.max_connections:
                await send_error(self.writer, "busy", f"source has {len(live)} connections")
                return
            live.add(self)
            keep_alive(self.writer)
            await self._handshake()
            while True:
                msg = await recv_message(self.reader, timeout_s=self.ctx.config.idle_timeout_s)
                if isinstance(msg, Pair):
                    async with self.lock:
                        await self._serve_pair(msg)
                elif isinstance(msg, Pull):
                    async with self.lock:
                        await self._serve_pull(msg)
                elif isinstance(msg, Release):
                    freed = self.ctx.outbox.release(msg.transfer_id)
                    log.debug("KV source: release %s from %s (freed now: %s)", msg.transfer_id, peer, freed)
                    await send_message(self.writer, Ack(msg.transfer_id), timeout_s=self.ctx.config.io_timeout_s)
                else:
                    await send_error(self.writer, "bad_request", f"unexpected {msg.TYPE} message")
                    return
        except ConnectionClosed as e:
            log.debug("KV source: %s: %s", peer, e)
        except AuthError as e:
            self.ctx.counts.auth_failures += 1
            log.warning("KV source: %s failed authentication: %s", peer, e)
        except CodecError as e:
            log.warning("KV source: %s sent a bad frame: %s", peer, e)
            await send_error(self.writer, "bad_request", str(e))
        except TransferError as e:
            log.warning("KV source: %s: %s", peer, e)
        except asyncio.CancelledError:
            pass  # stop(): fall through to the teardown
        except Exception:
            log.exception("KV source: %s: unexpected error", peer)
            await send_error(self.writer, "internal", "internal error")
        finally:
            live.discard(self)
            try:
                await self._teardown()
            except asyncio.CancelledError:
                pass  # stop() during the teardown: the pair's references are already dropped

    async def _handshake(self) -> None:
        timeout = self.ctx.config.handshake_timeout_s
        challenge = make_challenge(self.ctx.node_id)
        await send_message(self.writer, challenge, timeout_s=timeout)
        # A HELLO is a few hundred bytes: an unauthenticated peer may not make us buffer a 1 MiB frame.
        hello = await recv_message(self.reader, timeout_s=timeout, max_bytes=MAX_HELLO_BYTES)
        if not isinstance(hello, Hello):
            await send_error(self.writer, "auth", f"expected hello, got {hello.TYPE}")
            raise AuthError(f"expected hello, got {hello.TYPE}")
        try:
            verify_hello(self.ctx.secret, hello, challenge, max_skew_s=self.ctx.config.max_clock_skew_s)
        except AuthError as e:
            await send_error(self.writer, "auth", str(e))
            raise
        welcome = make_welcome(self.ctx.secret, self.ctx.node_id, hello, challenge)
        await send_message(self.writer, welcome, timeout_s=timeout)
        self.peer_id = hello.node_id

    async def _serve_pair(self, msg: Pair) -> None:
        """Set up this connection's data-plane pair: offer, PAIR_READY, open (both ends at once)."""
        cfg = self.ctx.config
        if self.transport is not None:
            return await self._refuse("-", "this connection already has its pair")
        if msg.transport != cfg.transport:
            return await self._refuse("-", f"source speaks {cfg.transport!r}, pair asked for {msg.transport!r}")
        transport = make_transport(cfg.transport, SOURCE_RANK, host=self.ctx.host, timeout_s=cfg.pair_timeout_s)
        try:
            offer = transport.offer(msg.transport_info)  # may refuse (nccl: both ends on one GPU)
        except TransferRefused as e:
            transport.close()
            return await self._refuse("-", e.reason)
        except BaseException:
            transport.close()
            raise
        self.transport = transport  # from here on the teardown closes it
        await send_message(self.writer, PairReady(offer), timeout_s=cfg.io_timeout_s)
        await run_bounded(self.ctx.executor, cfg.pair_timeout_s, f"opening the pair with {self.peer}",
                          open_pair, transport, offer, cfg.pair_timeout_s)
        self.ctx.counts.pairs += 1
        log.info("KV source: %s pair with %s (%s) is open", cfg.transport, self.peer, self.peer_id)

    async def _serve_pull(self, msg: Pull) -> None:
        cfg, tid = self.ctx.config, msg.transfer_id
        try:
            self.ctx.layout.check_compatible(msg.dst_layout)
            if msg.transport != cfg.transport:
                raise TransferRefused(f"source speaks {cfg.transport!r}, pull asked for {msg.transport!r}")
            entry = self.ctx.outbox.take_for_transfer(tid)
        except TransferRefused as e:
            return await self._refuse(tid, e.reason)
        ok = False
        stream: GatherStream | None = None
        try:  # checks that may still refuse: nothing announced yet
            n_blocks = self.ctx.layout.blocks_for_tokens(entry.n_tokens)
            transport = self.transport
            if msg.n_blocks != n_blocks:
                raise TransferRefused(f"transfer {tid} is {entry.n_tokens} tokens = {n_blocks} blocks, "
                                      f"destination reserved {msg.n_blocks}")
            direct = transport_class(cfg.transport).direct
            if (msg.dst_runs is not None) != direct:
                raise TransferRefused(f"dst_runs {'missing' if direct else 'given'} for the "
                                      f"{cfg.transport} transport")
            if transport is None or not transport.is_open:
                raise TransferRefused(f"no {cfg.transport} pair on this connection: the destination "
                                      "sets it up (PAIR) when it meets this source, before any pull")
            nbytes = n_blocks * self.ctx.layout.block_nbytes
        except TransferRefused as e:
            self.ctx.outbox.requeue(tid)
            return await self._refuse(tid, e.reason)
        except BaseException:
            self.ctx.outbox.requeue(tid)
            raise
        # Announced: from here on a failure is no refusal; it ends the pair (and the connection).
        try:
            await send_message(self.writer, PullReady(tid, entry.n_tokens, n_blocks, nbytes),
                               timeout_s=cfg.io_timeout_s)
            t0 = time.monotonic()
            blocks = list(entry.block_ids[:n_blocks])
            timeout = cfg.transfer_timeout_s
            if direct:  # one gather, then the runs (a device-side copy: cheap on a GPU)
                tensors = await run_to_completion(self.ctx.executor, source_tensors, self.ctx.cache, blocks,
                                                  msg.dst_runs)
                work = functools.partial(send_all, transport, tensors, timeout)
            else:  # chunk by chunk through a small ring, gathering while the wire runs
                stream = GatherStream(self.ctx.cache, blocks, self.ctx.staging)
                work = functools.partial(send_streamed, transport, stream, timeout)
            done = await self._send_and_await_done(tid, work)
            if not isinstance(done, Done) or done.transfer_id != tid:
                raise TransferError(f"expected done for {tid}, got {done.TYPE}")
            self.ctx.outbox.done(tid)
            ok = True
            self.ctx.counts.transfers += 1
            self.ctx.counts.bytes_sent += nbytes
            self.ctx.counts.seconds_sending += time.monotonic() - t0
            await send_message(self.writer, Ack(tid), timeout_s=cfg.io_timeout_s)
        except TransferRefused as e:  # e.g. raised by a transport's open: not a refusal any more
            self.ctx.counts.failed += 1
            raise TransferError(f"transfer {tid} failed after it was announced: {e.reason}") from None
        except BaseException:
            self.ctx.counts.failed += 1
            raise  # the connection (and with it the pair) is torn down by the caller
        finally:
            if not ok:
                if stream is not None:
                    stream.cancel()  # no block is read after this returns (at most one layer's copy)
                self.ctx.outbox.requeue(tid)

    async def _send_and_await_done(self, tid: str, work: Callable[[], None]) -> Message:
        """Send on the data plane while already reading the control channel for DONE.

        The control connection is the liveness signal: a destination that dies closes it at once,
        while the data plane may only notice at its timeout. DONE can also arrive before the send's
        own completion is observed; both are awaited then.
        """
        timeout = self.ctx.config.transfer_timeout_s
        send = asyncio.ensure_future(run_bounded(self.ctx.executor, timeout, f"sending {tid} to {self.peer}", work))
        reply = asyncio.ensure_future(recv_message(self.reader, timeout_s=timeout))
        try:
            finished, _ = await asyncio.wait({send, reply}, return_when=asyncio.FIRST_COMPLETED)
            if reply in finished and reply.exception() is not None:
                raise TransferError(f"destination {self.peer} gave up during {tid}: {reply.exception()}")
            await send
            return await reply
        finally:
            for f in (send, reply):
                if not f.done():
                    f.cancel()

    async def _refuse(self, tid: str, reason: str) -> None:
        self.ctx.counts.refused += 1
        log.info("KV source: refused %s: %s", tid, reason)
        await send_message(self.writer, Error("refused", reason), timeout_s=self.ctx.config.io_timeout_s)

    async def _teardown(self) -> None:
        transport, self.transport = self.transport, None
        self.writer.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.writer.wait_closed(), 1.0)
        if transport is not None:
            with contextlib.suppress(Exception):
                await run_bounded(self.ctx.executor, 10.0, "closing a pair", transport.close)


async def send_error(writer: asyncio.StreamWriter, code: str, reason: str) -> None:
    with contextlib.suppress(Exception):  # best effort: the connection is going away anyway
        await send_message(writer, Error(code, reason), timeout_s=1.0)
