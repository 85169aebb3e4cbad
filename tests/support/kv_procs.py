"""KV source and destination OS processes for the two-process and fuzz tests (and their typed commands).

Each process runs one asyncio loop with a `KVSource` (prefill side) or a `KVPuller` (decode side)
and obeys typed commands from the parent over a `multiprocessing` pipe (`Proc`: every wait has a
deadline, cleanup always kills). Block books are a plain shuffled free list, so block ids are
scattered like a real pool's. The source's `SourceConfig` is the caller's: the fuzz tests want short
handshake and I/O timeouts and a small connection limit, so a misbehaving peer's cost is visible.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing as mp
import random
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

from kv_transfer.client import KVPuller, PullerConfig
from kv_transfer.gloo import GlooTransport
from kv_transfer.handle import KVHandle
from kv_transfer.layout import KVLayout
from kv_transfer.outbox import Outbox
from kv_transfer.server import KVSource, SourceConfig, SourceStats
from kv_transfer.transport import ChunkSource, register_transport
from tests.support.kv_caches import SECRET, digest, make_cache

# --- a source that stalls halfway through a transfer (so a test can kill it mid-transfer) ---------


class _StallHalfway:
    def __init__(self, inner: ChunkSource, stall_s: float) -> None:
        self.inner, self.stall_s = inner, stall_s
        self.count, self.window = inner.count, inner.window

    def buffer(self, i: int) -> torch.Tensor:
        return self.inner.buffer(i)

    def fill(self, i: int) -> None:
        if i == self.count // 2:
            time.sleep(self.stall_s)
        self.inner.fill(i)


@register_transport
class StallingGloo(GlooTransport):
    """gloo, except that the source pauses for 3 s after sending half of every transfer."""

    name = "gloo-stall"

    def send_stream(self, stream: ChunkSource, timeout_s: float) -> None:
        super().send_stream(_StallHalfway(stream, 3.0), timeout_s)


# --- commands and replies -------------------------------------------------------------------------


@dataclass(frozen=True)
class Started:
    address: tuple[str, int]


@dataclass(frozen=True)
class Offer:
    n_tokens: int
    count: int = 1
    lease_s: float | None = None


@dataclass(frozen=True)
class Offered:
    handle: KVHandle
    digest: str  # of the blocks that will travel, taken at offer time


@dataclass(frozen=True)
class GetStats:
    pass


@dataclass(frozen=True)
class SourceReport:
    stats: SourceStats
    leftovers: str | None  # Outbox.check_empty's complaint, None when empty
    free_blocks: int


@dataclass(frozen=True)
class PullAll:
    """Pull every handle concurrently; optionally with another secret or (lying) layout."""

    handles: tuple[KVHandle, ...]
    timeout_s: float = 20.0
    secret: bytes | None = None
    layout: KVLayout | None = None  # pull as this layout, and claim the handle has it too
    transport: str | None = None


@dataclass(frozen=True)
class Outcome:
    transfer_id: str
    digest: str | None
    error: str | None  # exception class name
    message: str
    seconds: float


@dataclass(frozen=True)
class Release:
    handles: tuple[KVHandle, ...]


@dataclass(frozen=True)
class Stop:
    pass


# --- source process -------------------------------------------------------------------------------


#: the two-process tests' source: loopback, leases swept every 50 ms
SOURCE = SourceConfig(host="127.0.0.1", expire_interval_s=0.05)


def source_main(conn: Connection, layout: KVLayout, num_blocks: int, seed: int, config: SourceConfig = SOURCE,
                lease_s: float = 30.0, log_level: int = logging.WARNING) -> None:
    torch.set_num_threads(1)
    logging.basicConfig(level=log_level)
    asyncio.run(_source(conn, layout, num_blocks, seed, config, lease_s))


async def _source(conn: Connection, layout: KVLayout, num_blocks: int, seed: int, config: SourceConfig,
                  lease_s: float) -> None:
    cache = make_cache(layout, num_blocks, seed=seed)
    rng = random.Random(seed)
    free = list(range(num_blocks))
    rng.shuffle(free)
    outbox = Outbox(free.extend, default_lease_s=lease_s)
    server = KVSource(cache, outbox, SECRET, layout, config)
    await server.start()
    conn.send(Started(server.address))
    while True:
        try:
            cmd = await asyncio.to_thread(conn.recv)
        except EOFError:  # the parent is gone
            break
        if isinstance(cmd, Offer):
            out = []
            for _ in range(cmd.count):
                n = layout.blocks_for_tokens(cmd.n_tokens)
                blocks = [free.pop() for _ in range(n)]
                h = server.offer(None, blocks, cmd.n_tokens, lease_s=cmd.lease_s)
                out.append(Offered(h, digest(cache, blocks)))
            conn.send(out)
        elif isinstance(cmd, GetStats):
            try:
                outbox.check_empty()
                leftovers = None
            except AssertionError as e:
                leftovers = str(e)
            conn.send(SourceReport(server.stats(), leftovers, len(free)))
        elif isinstance(cmd, Stop):
            break
    await server.stop()
    conn.send("stopped")


# --- destination process --------------------------------------------------------------------------


def dest_main(conn: Connection, layout: KVLayout, num_blocks: int) -> None:
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    asyncio.run(_dest(conn, layout, num_blocks))


async def _dest(conn: Connection, layout: KVLayout, num_blocks: int) -> None:
    cache = make_cache(layout, num_blocks)
    free = list(range(num_blocks))
    random.Random(0).shuffle(free)
    puller = KVPuller(SECRET, layout, PullerConfig(host="127.0.0.1"))
    conn.send(Started(("127.0.0.1", 0)))
    while True:
        try:
            cmd = await asyncio.to_thread(conn.recv)
        except EOFError:
            break
        if isinstance(cmd, PullAll):
            if cmd.secret is None and cmd.layout is None and cmd.transport is None:
                outcomes = await asyncio.gather(*(_pull(puller, h, cache, free, cmd.timeout_s) for h in cmd.handles))
            else:  # a one-off puller: another secret, transport, or model layout
                lay = cmd.layout or layout
                other = KVPuller(cmd.secret or SECRET, lay,
                                 PullerConfig(host="127.0.0.1", transport=cmd.transport or "gloo"))
                n = max(64, *(h.n_blocks for h in cmd.handles))
                other_cache = make_cache(lay, n)
                handles = [dataclasses.replace(h, layout=lay) for h in cmd.handles]
                outcomes = await asyncio.gather(*(_pull(other, h, other_cache, list(range(n)), cmd.timeout_s)
                                                  for h in handles))
                await other.close()
            conn.send(list(outcomes))
        elif isinstance(cmd, Release):
            for h in cmd.handles:
                await puller.release(h)
            conn.send("released")
        elif isinstance(cmd, Stop):
            break
    await puller.close()
    conn.send("stopped")


async def _pull(puller: KVPuller, h: KVHandle, cache: Any, free: list[int], timeout_s: float) -> Outcome:
    blocks = [free.pop() for _ in range(h.n_blocks)]
    t0 = time.monotonic()
    try:
        await puller.pull(h, cache, blocks, timeout_s=timeout_s)
        return Outcome(h.transfer_id, digest(cache, blocks), None, "", time.monotonic() - t0)
    except Exception as e:
        return Outcome(h.transfer_id, None, type(e).__name__, str(e), time.monotonic() - t0)
    finally:
        free.extend(blocks)


# --- parent side ----------------------------------------------------------------------------------


class Proc:
    """A spawned child with a command pipe; every wait has a deadline, cleanup always kills."""

    def __init__(self, target: Any, *args: Any) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(child, *args), daemon=True)
        self.proc.start()
        child.close()
        self.address: tuple[str, int] | None = None

    def ready(self, timeout_s: float = 60.0) -> Proc:
        """Wait for the child's Started message (spawn + torch import + cache setup)."""
        started = self.recv(timeout_s)
        assert isinstance(started, Started), started
        self.address = started.address
        return self

    def send(self, cmd: object) -> None:
        self.conn.send(cmd)

    def recv(self, timeout_s: float) -> Any:
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"child {self.proc.pid} did not answer within {timeout_s}s")
        return self.conn.recv()

    def call(self, cmd: object, timeout_s: float = 60.0) -> Any:
        self.send(cmd)
        return self.recv(timeout_s)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(10)

    def stop(self) -> None:
        try:
            if self.proc.is_alive():
                self.call(Stop(), timeout_s=15)
        except (OSError, EOFError, TimeoutError):
            pass
        finally:
            self.proc.join(5)
            if self.proc.is_alive():
                self.kill()
            self.conn.close()
