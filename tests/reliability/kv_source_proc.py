"""A `KVSource` in a child process with tight timeouts, obeying `tests.kv_transfer.kvt_procs` commands.

The same command protocol as ``kvt_procs.source_main`` (``Offer`` → ``Offered``, ``GetStats`` →
``SourceReport``, ``Stop``), but the `SourceConfig` is the caller's: the fuzz tests want short
handshake and I/O timeouts and a small connection limit, so a misbehaving peer's cost is visible.
"""

from __future__ import annotations

import asyncio
import logging
import random
from multiprocessing.connection import Connection

import torch

from kv_transfer.layout import KVLayout
from kv_transfer.outbox import Outbox
from kv_transfer.server import KVSource, SourceConfig
from tests.kv_transfer.kvt_helpers import SECRET, digest, make_cache
from tests.kv_transfer.kvt_procs import GetStats, Offer, Offered, SourceReport, Started, Stop


def source_main(conn: Connection, layout: KVLayout, num_blocks: int, seed: int, config: SourceConfig) -> None:
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.ERROR)  # the fuzzers make the source log a warning per peer
    asyncio.run(_source(conn, layout, num_blocks, seed, config))


async def _source(conn: Connection, layout: KVLayout, num_blocks: int, seed: int, config: SourceConfig) -> None:
    cache = make_cache(layout, num_blocks, seed=seed)
    free = list(range(num_blocks))
    random.Random(seed).shuffle(free)
    outbox = Outbox(free.extend, default_lease_s=60)
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
                blocks = [free.pop() for _ in range(layout.blocks_for_tokens(cmd.n_tokens))]
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
