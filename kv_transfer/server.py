"""`KVSource`: the prefill worker's KV server: outbox leases, authenticated control channel, data plane.

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
import functools
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.kv_cache import KVCache
from kv_transfer.auth import DEFAULT_MAX_SKEW_S, check_secret, make_challenge, make_welcome, verify_hello
from kv_transfer.blocking import make_executor, run_bounded, run_to_completion
from kv_transfer.blocks import source_tensors
from kv_transfer.dataplane import open_pair, send_all, send_streamed
from kv_transfer.errors import AuthError, CodecError, ConnectionClosed, TransferError, TransferRefused
from kv_transfer.framing import keep_alive, recv_message, send_message
from kv_transfer.handle import KVHandle
from kv_transfer.layout import KVLayout
from kv_transfer.messages import Ack, Done, Error, Hello, Message, Pair, PairReady, Pull, PullReady, Release
from kv_transfer.node import default_node_id, node_ip
from kv_transfer.outbox import Outbox, OutboxStats
from kv_transfer.staging import StagingPool
from kv_transfer.streams import GatherStream, min_inflight_bytes
from kv_transfer.transport import (
    SOURCE_RANK,
    KVTransport,
    check_transport_available,
    make_transport,
    transport_class,
)

log = logging.getLogger(__name__)

#: Largest frame accepted before authentication (a HELLO is under 400 bytes).
MAX_HELLO_BYTES = 4096


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


@dataclass(eq=False)  # identity semantics: pairs live in a set
class _Pair:
    """One connected, authenticated destination = one data-plane pair."""

    peer: str
    peer_id: str = ""
    transport: KVTransport | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


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
        self._pairs: set[_Pair] = set()
        self._tasks: set[asyncio.Task[object]] = set()
        self._executor = make_executor("kv-source", config.max_threads)  # replaced by each start()
        if config.max_inflight_bytes < min_inflight_bytes():
            raise ValueError(f"max_inflight_bytes={config.max_inflight_bytes} is below the "
                             f"{min_inflight_bytes()} bytes of one staging chunk")
        self._pool = StagingPool(config.max_inflight_bytes)
        self._port = 0
        self._n = {"transfers": 0, "bytes": 0, "refused": 0, "failed": 0, "auth": 0, "pairs": 0}
        self._seconds = 0.0

    # --- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        if self._server is not None:
            return
        self._executor = make_executor("kv-source", self.config.max_threads)
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
        host, port = (self.host, self._port)
        return SourceStats(host=host, port=port, connections=len(self._pairs),
                           transfers=self._n["transfers"], bytes_sent=self._n["bytes"],
                           seconds_sending=self._seconds, refused=self._n["refused"],
                           failed=self._n["failed"], auth_failures=self._n["auth"],
                           outbox=self.outbox.stats(), pairs=self._n["pairs"],
                           staging_peak_bytes=self._pool.peak_bytes)

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

    # --- one connection -----------------------------------------------------------------------

    async def _on_connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        host, port = writer.get_extra_info("peername")[:2]
        peer = f"{host}:{port}"
        pair = _Pair(peer=peer)
        try:
            if len(self._pairs) >= self.config.max_connections:
                await self._send_error(writer, "busy", f"source has {len(self._pairs)} connections")
                return
            self._pairs.add(pair)
            keep_alive(writer)
            await self._handshake(pair, reader, writer)
            while True:
                msg = await recv_message(reader, timeout_s=self.config.idle_timeout_s)
                if isinstance(msg, Pair):
                    async with pair.lock:
                        await self._serve_pair(pair, msg, writer)
                elif isinstance(msg, Pull):
                    async with pair.lock:
                        await self._serve_pull(pair, msg, reader, writer)
                elif isinstance(msg, Release):
                    freed = self.outbox.release(msg.transfer_id)
                    log.debug("KV source: release %s from %s (freed now: %s)", msg.transfer_id, peer, freed)
                    await send_message(writer, Ack(msg.transfer_id), timeout_s=self.config.io_timeout_s)
                else:
                    await self._send_error(writer, "bad_request", f"unexpected {msg.TYPE} message")
                    return
        except ConnectionClosed as e:
            log.debug("KV source: %s: %s", peer, e)
        except AuthError as e:
            self._n["auth"] += 1
            log.warning("KV source: %s failed authentication: %s", peer, e)
        except CodecError as e:
            log.warning("KV source: %s sent a bad frame: %s", peer, e)
            await self._send_error(writer, "bad_request", str(e))
        except TransferError as e:
            log.warning("KV source: %s: %s", peer, e)
        except asyncio.CancelledError:
            pass  # stop(): fall through to the teardown
        except Exception:
            log.exception("KV source: %s: unexpected error", peer)
            await self._send_error(writer, "internal", "internal error")
        finally:
            self._pairs.discard(pair)
            try:
                await self._teardown(pair, writer)
            except asyncio.CancelledError:
                pass  # stop() during the teardown: the pair's references are already dropped
            self._tasks.discard(task)

    async def _handshake(self, pair: _Pair, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        timeout = self.config.handshake_timeout_s
        challenge = make_challenge(self.node_id)
        await send_message(writer, challenge, timeout_s=timeout)
        # A HELLO is a few hundred bytes: an unauthenticated peer may not make us buffer a 1 MiB frame.
        hello = await recv_message(reader, timeout_s=timeout, max_bytes=MAX_HELLO_BYTES)
        if not isinstance(hello, Hello):
            await self._send_error(writer, "auth", f"expected hello, got {hello.TYPE}")
            raise AuthError(f"expected hello, got {hello.TYPE}")
        try:
            verify_hello(self._secret, hello, challenge, max_skew_s=self.config.max_clock_skew_s)
        except AuthError as e:
            await self._send_error(writer, "auth", str(e))
            raise
        await send_message(writer, make_welcome(self._secret, self.node_id, hello, challenge), timeout_s=timeout)
        pair.peer_id = hello.node_id

    async def _serve_pair(self, pair: _Pair, msg: Pair, writer: asyncio.StreamWriter) -> None:
        """Set up this connection's data-plane pair: offer, PAIR_READY, open (both ends at once)."""
        cfg = self.config
        if pair.transport is not None:
            return await self._refuse(writer, "-", "this connection already has its pair")
        if msg.transport != cfg.transport:
            return await self._refuse(writer, "-", f"source speaks {cfg.transport!r}, pair asked for {msg.transport!r}")
        transport = make_transport(cfg.transport, SOURCE_RANK, host=self.host, timeout_s=cfg.pair_timeout_s)
        try:
            offer = transport.offer(msg.transport_info)  # may refuse (nccl: both ends on one GPU)
        except TransferRefused as e:
            transport.close()
            return await self._refuse(writer, "-", e.reason)
        except BaseException:
            transport.close()
            raise
        pair.transport = transport  # from here on the teardown closes it
        await send_message(writer, PairReady(offer), timeout_s=cfg.io_timeout_s)
        await run_bounded(self._executor, cfg.pair_timeout_s, f"opening the pair with {pair.peer}",
                          open_pair, transport, offer, cfg.pair_timeout_s)
        self._n["pairs"] += 1
        log.info("KV source: %s pair with %s (%s) is open", cfg.transport, pair.peer, pair.peer_id)

    async def _serve_pull(self, pair: _Pair, msg: Pull, reader: asyncio.StreamReader,
                          writer: asyncio.StreamWriter) -> None:
        cfg, tid = self.config, msg.transfer_id
        try:
            self.layout.check_compatible(msg.dst_layout)
            if msg.transport != cfg.transport:
                raise TransferRefused(f"source speaks {cfg.transport!r}, pull asked for {msg.transport!r}")
            entry = self.outbox.take_for_transfer(tid)
        except TransferRefused as e:
            return await self._refuse(writer, tid, e.reason)
        ok = False
        stream: GatherStream | None = None
        try:  # checks that may still refuse: nothing announced yet
            n_blocks = self.layout.blocks_for_tokens(entry.n_tokens)
            transport = pair.transport
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
            nbytes = n_blocks * self.layout.block_nbytes
        except TransferRefused as e:
            self.outbox.requeue(tid)
            return await self._refuse(writer, tid, e.reason)
        except BaseException:
            self.outbox.requeue(tid)
            raise
        # Announced: from here on a failure is no refusal; it ends the pair (and the connection).
        try:
            await send_message(writer, PullReady(tid, entry.n_tokens, n_blocks, nbytes),
                               timeout_s=cfg.io_timeout_s)
            t0 = time.monotonic()
            blocks = list(entry.block_ids[:n_blocks])
            timeout = cfg.transfer_timeout_s
            if direct:  # one gather, then the runs (a device-side copy: cheap on a GPU)
                tensors = await run_to_completion(self._executor, source_tensors, self.cache, blocks, msg.dst_runs)
                work = functools.partial(send_all, transport, tensors, timeout)
            else:  # chunk by chunk through a small ring, gathering while the wire runs
                stream = GatherStream(self.cache, blocks, self._pool)
                work = functools.partial(send_streamed, transport, stream, timeout)
            done = await self._send_and_await_done(pair, tid, work, reader)
            if not isinstance(done, Done) or done.transfer_id != tid:
                raise TransferError(f"expected done for {tid}, got {done.TYPE}")
            self.outbox.done(tid)
            ok = True
            self._n["transfers"] += 1
            self._n["bytes"] += nbytes
            self._seconds += time.monotonic() - t0
            await send_message(writer, Ack(tid), timeout_s=cfg.io_timeout_s)
        except TransferRefused as e:  # e.g. raised by a transport's open: not a refusal any more
            self._n["failed"] += 1
            raise TransferError(f"transfer {tid} failed after it was announced: {e.reason}") from None
        except BaseException:
            self._n["failed"] += 1
            raise  # the connection (and with it the pair) is torn down by the caller
        finally:
            if not ok:
                if stream is not None:
                    stream.cancel()  # no block is read after this returns (at most one layer's copy)
                self.outbox.requeue(tid)

    async def _send_and_await_done(self, pair: _Pair, tid: str, work: Callable[[], None],
                                   reader: asyncio.StreamReader) -> Message:
        """Send on the data plane while already reading the control channel for DONE.

        The control connection is the liveness signal: a destination that dies closes it at once,
        while the data plane may only notice at its timeout. DONE can also arrive before the send's
        own completion is observed; both are awaited then.
        """
        timeout = self.config.transfer_timeout_s
        send = asyncio.ensure_future(run_bounded(self._executor, timeout, f"sending {tid} to {pair.peer}", work))
        reply = asyncio.ensure_future(recv_message(reader, timeout_s=timeout))
        try:
            finished, _ = await asyncio.wait({send, reply}, return_when=asyncio.FIRST_COMPLETED)
            if reply in finished and reply.exception() is not None:
                raise TransferError(f"destination {pair.peer} gave up during {tid}: {reply.exception()}")
            await send
            return await reply
        finally:
            for f in (send, reply):
                if not f.done():
                    f.cancel()

    async def _refuse(self, writer: asyncio.StreamWriter, tid: str, reason: str) -> None:
        self._n["refused"] += 1
        log.info("KV source: refused %s: %s", tid, reason)
        await send_message(writer, Error("refused", reason), timeout_s=self.config.io_timeout_s)

    async def _send_error(self, writer: asyncio.StreamWriter, code: str, reason: str) -> None:
        with contextlib.suppress(Exception):  # best effort: the connection is going away anyway
            await send_message(writer, Error(code, reason), timeout_s=1.0)

    async def _teardown(self, pair: _Pair, writer: asyncio.StreamWriter) -> None:
        transport, pair.transport = pair.transport, None
        writer.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(writer.wait_closed(), 1.0)
        if transport is not None:
            with contextlib.suppress(Exception):
                await run_bounded(self._executor, 10.0, "closing a pair", transport.close)
