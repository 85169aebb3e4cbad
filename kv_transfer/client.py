"""`KVPuller`: the decode worker's side: pull a handle's KV blocks into reserved blocks of its cache.

Life cycle of a pull (the decode scheduler reserved ``dst_block_ids`` first):

    meet_sources(the prefill pool's sources) (start-up and every change: `keeper.py`), or meet(source),
    or, for a source not met yet, the first handle naming it (counted in ``pulls_unpaired``)
      ─▶ connect + CHALLENGE / HELLO / WELCOME ─▶ PAIR ─▶ PAIR_READY ─▶ both open the pair
    pull(handle, cache, block_ids)
      ─▶ local checks (layout, block ids)            ─▶ TransferRefused / ValueError, nothing sent
      ─▶ the pair with the source (waits, within the deadline, for a meeting under way)
      ─▶ per-source lock (one transfer at a time per pair; other sources run concurrently)
      ─▶ PULL ─▶ PULL_READY | ERROR{refused} (→ TransferRefused, the connection stays)
      ─▶ receive (worker thread, bounded): chunk by chunk through a small ring of staging slots,
         scattered into the blocks while the next chunks arrive (streams.py), or straight into the
         blocks (direct transports, in-process only)
      ─▶ DONE ─▶ ACK (the source has freed its copy) ─▶ PullStats

Invariants: everything happens within ``timeout_s`` or raises `TransferTimeout`; no pull sets up a
pair (or an NCCL communicator) inside its deadline; the event loop never blocks (receive, scatter,
open and close run in a dedicated executor); staging memory of all pulls together stays within
``max_inflight_bytes`` (`StagingPool`); any failure other than a refusal tears down that source's
connection and pair (the next pull meets the source again), so a dead or silent source leaves
nothing hanging and never affects pulls from other sources; a cancelled pull never writes the
blocks after it returns (the scatter stream is cancelled; direct transports are aborted); the
destination's blocks hold valid data only if `pull` returned.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

from engine.kv_cache import KVCache
from kv_transfer.auth import check_secret
from kv_transfer.blocking import make_executor, run_bounded
from kv_transfer.blocks import direct_views, run_lengths
from kv_transfer.config import KVTransferConfig
from kv_transfer.dataplane import recv_all, recv_streamed
from kv_transfer.errors import ConnectionClosed, TransferError, TransferRefused, TransferTimeout
from kv_transfer.framing import recv_message, send_message
from kv_transfer.handle import KVHandle
from kv_transfer.keeper import Backoff, KeeperStats, Plan, SourceKeeper
from kv_transfer.layout import KVLayout
from kv_transfer.messages import Ack, Done, Pull, PullReady, Release
from kv_transfer.node import default_node_id, node_ip
from kv_transfer.peers import Conn, Peers, PeersConfig, Source
from kv_transfer.staging import StagingPool
from kv_transfer.streams import ScatterStream, min_inflight_bytes
from kv_transfer.transport import check_transport_available

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PullerConfig:
    host: str | None = None  # this node's data-plane address (gloo binds here); None: node_ip()
    transport: str = "gloo"
    node_id: str | None = None
    connect_timeout_s: float = 10.0
    close_timeout_s: float = 10.0
    pair_timeout_s: float = 60.0  # meeting a source: connect, authenticate, set up and open the pair
    max_threads: int = 8
    max_inflight_bytes: int = 64 << 20  # staging buffers of all pulls (StagingPool), lent + idle


@dataclass(frozen=True)
class PullStats:
    transfer_id: str
    nbytes: int
    seconds: float  # PULL_READY → data in the blocks (data plane + scatter; not connect/queueing)
    n_blocks: int

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


class KVPuller:
    """Pulls KV from `KVSource`s into this process's cache; one per decode worker."""

    def __init__(self, secret: bytes, layout: KVLayout, config: PullerConfig | None = None) -> None:
        self.config = config = config or PullerConfig()
        check_transport_available(config.transport)  # fails at startup, not at the first pull
        if config.max_inflight_bytes < min_inflight_bytes():
            raise ValueError(f"max_inflight_bytes={config.max_inflight_bytes} is below the "
                             f"{min_inflight_bytes()} bytes of one staging chunk")
        self.layout = layout
        self.host = config.host or node_ip()
        self.node_id = config.node_id or default_node_id("decode")
        self._executor = make_executor("kv-puller", config.max_threads)
        self._pool = StagingPool(config.max_inflight_bytes)
        self.peers = Peers(check_secret(secret), PeersConfig(
            host=self.host, transport=config.transport, node_id=self.node_id,
            connect_timeout_s=config.connect_timeout_s, pair_timeout_s=config.pair_timeout_s,
            close_timeout_s=config.close_timeout_s), self._executor)
        self.keeper = SourceKeeper(self.peers, Backoff())
        self._keeping: asyncio.Task[None] | None = None
        self.pulls_unpaired = 0  # pulls that found no pair with their source and waited for a meeting
        self._closed = False

    # --- public -------------------------------------------------------------------------------

    async def meet(self, source: Source) -> None:
        """Set up the pair with ``source`` now (e.g. at start-up); idempotent; bounded by ``pair_timeout_s``."""
        self._check_open()
        await self.peers.wait_paired(source, self.config.pair_timeout_s + 1.0, f"meeting {source}")

    def meet_sources(self, sources: Iterable[Source]) -> Plan:
        """The prefill pool's sources now: meet new ones in the background, forget those gone (never blocks)."""
        self._check_open()
        return self.keeper.update(sources)

    def keep_sources(self, listed: Callable[[], Iterable[Source]], interval_s: float) -> None:
        """Poll ``listed`` every ``interval_s`` and `meet_sources` from it, until `close`; idempotent."""
        self._check_open()
        if self._keeping is None:
            self._keeping = asyncio.create_task(self.keeper.run(listed, interval_s), name="kv-source-keeper")

    def pair_stats(self) -> KeeperStats:
        return self.keeper.stats()

    @property
    def staging(self) -> StagingPool:
        return self._pool

    async def pull(self, handle: KVHandle, dst_cache: KVCache, dst_block_ids: list[int],
                   timeout_s: float = KVTransferConfig.timeout_s) -> PullStats:
        """Receive ``handle``'s blocks into ``dst_block_ids`` (the first ``handle.n_blocks`` of them)."""
        handle.layout.check_compatible(self.layout)  # the source re-checks; this fails fast
        self.layout.check_cache(dst_cache)
        blocks = _check_block_ids(dst_block_ids, handle.n_blocks, dst_cache.num_blocks)
        self._check_open()
        what = f"pull {handle.transfer_id}"
        deadline = asyncio.get_running_loop().time() + timeout_s
        if self.peers.paired(handle.source) is None:
            self.pulls_unpaired += 1
        for attempt in range(2):
            await self.peers.wait_paired(handle.source, self._left(deadline), what)
            async with self.peers.lock(handle.source, self._left(deadline), what):
                conn = self.peers.paired(handle.source)
                if conn is None:  # lost between the meeting and now (the peer closed it)
                    await self.peers.drop(handle.source)
                    if attempt:
                        raise TransferError(f"{what}: the pair with {handle.source} was lost before the pull")
                    continue
                try:
                    return await self._pull_on(conn, handle, dst_cache, blocks, deadline)
                except TransferRefused:
                    raise  # nothing moved; the pair is intact
                except _Stale as e:
                    await self.peers.drop(handle.source)
                    if attempt:
                        raise TransferError(f"{what}: {handle.source}: {e}") from None
                    log.debug("KV puller: connection to %s was stale, meeting it again", handle.source)
                except BaseException:
                    await self.peers.drop(handle.source)
                    raise
        raise AssertionError("unreachable")

    async def release(self, handle: KVHandle, timeout_s: float = 10.0) -> None:
        """Tell the source to free ``handle``'s blocks without sending them (e.g. the request was aborted).

        Uses the pair's connection when there is one, else a connection of its own, closed after."""
        self._check_open()
        deadline = asyncio.get_running_loop().time() + timeout_s
        what = f"release {handle.transfer_id}"
        async with self.peers.lock(handle.source, self._left(deadline), what):
            paired = self.peers.paired(handle.source)
            conn = paired or await self.peers.connect(handle.source, deadline)
            try:
                await send_message(conn.writer, Release(handle.transfer_id), timeout_s=self._left(deadline))
                reply = await self.peers.recv(conn, deadline)
                if not isinstance(reply, Ack) or reply.transfer_id != handle.transfer_id:
                    raise TransferError(f"{what}: unexpected {reply.TYPE} reply")
            except BaseException:
                if paired is not None:
                    await self.peers.drop(handle.source)
                raise
            finally:
                if paired is None:
                    conn.writer.close()

    async def close(self) -> None:
        self._closed = True
        if self._keeping is not None:
            self._keeping.cancel()
            await asyncio.gather(self._keeping, return_exceptions=True)
        await self.keeper.close()
        await self.peers.close()
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError("KVPuller is closed")

    # --- one pull on one connection -----------------------------------------------------------

    async def _pull_on(self, conn: Conn, handle: KVHandle, cache: KVCache, blocks: list[int],
                       deadline: float) -> PullStats:
        tid, n_blocks = handle.transfer_id, len(blocks)
        transport = conn.transport
        assert transport is not None
        runs = run_lengths(blocks) if transport.direct else None
        try:
            await send_message(conn.writer, Pull(tid, self.layout, n_blocks, transport.name, runs),
                               timeout_s=self._left(deadline))
            ready = await self.peers.recv(conn, deadline)
        except ConnectionClosed as e:
            raise _Stale(str(e)) from None
        if not isinstance(ready, PullReady):
            raise TransferError(f"pull {tid}: expected pull_ready, got {ready.TYPE}")
        _check_ready(ready, handle, n_blocks)
        t0 = time.monotonic()
        left = self._left(deadline)
        stream: ScatterStream | None = None
        if transport.direct:  # straight into the blocks
            work = functools.partial(recv_all, transport, direct_views(cache, blocks), left)
        else:  # chunk by chunk through a small ring, scattering while the wire runs
            stream = ScatterStream(cache, blocks, self._pool)
            work = functools.partial(recv_streamed, transport, stream, left)
        try:
            await self._recv_watching(conn, tid, run_bounded(
                self._executor, left, f"receiving {tid} from {handle.source}", work), deadline)
        except BaseException:
            if stream is not None:
                stream.cancel()  # blocks are never written after this returns (≤ one chunk's copy)
            raise
        seconds = time.monotonic() - t0
        await send_message(conn.writer, Done(tid, ready.nbytes, seconds), timeout_s=self._left(deadline))
        ack = await self.peers.recv(conn, deadline)
        if not isinstance(ack, Ack) or ack.transfer_id != tid:
            raise TransferError(f"pull {tid}: expected ack, got {ack.TYPE}")
        return PullStats(transfer_id=tid, nbytes=ready.nbytes, seconds=seconds, n_blocks=n_blocks)

    async def _recv_watching(self, conn: Conn, tid: str, work: Awaitable[None], deadline: float) -> None:
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
