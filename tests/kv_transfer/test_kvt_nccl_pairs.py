"""KVSource ↔ KVPuller over the nccl transport on the fake cupy: when pairs are set up, how many
sends a transfer costs, and how much staging memory transfers hold.

The fake (tests/support/fake_cupy.py) takes exactly real cupy's types (test_kvt_cupy_api.py holds
it to the same contract as real cupy), so these run the code path a GPU runs, on CPU tensors.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import Counter
from typing import Any

import pytest

from kv_transfer import streams
from kv_transfer.client import KVPuller, PullerConfig
from kv_transfer.errors import TransferRefused, TransferTimeout
from kv_transfer.framing import send_message
from kv_transfer.messages import Pull
from kv_transfer.outbox import Outbox
from kv_transfer.server import KVSource, SourceConfig
from tests.support import fake_cupy
from tests.support.kv_caches import SECRET, SMOL, digest, make_cache

pytestmark = pytest.mark.timeout(60)
LAYOUT = dataclasses.replace(SMOL, num_layers=4)
BLOCK_LAYER_BYTES = LAYOUT.block_nbytes // LAYOUT.num_layers  # K + V of one block in one layer


class Pair:
    """A started source and a puller over one transport (``inflight``: both sides' staging budget)."""

    def __init__(self, transport: str, inflight: int = 64 << 20) -> None:
        self.cache = make_cache(LAYOUT, 64, seed=7)
        self.freed: Counter[int] = Counter()
        outbox = Outbox(lambda b: self.freed.update(b), default_lease_s=30)
        self.source = KVSource(self.cache, outbox, SECRET, LAYOUT, SourceConfig(
            host="127.0.0.1", transport=transport, max_inflight_bytes=inflight))
        self.puller = KVPuller(SECRET, LAYOUT, PullerConfig(host="127.0.0.1", transport=transport,
                                                            max_inflight_bytes=inflight))

    async def __aenter__(self) -> Pair:
        await self.source.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.puller.close()
        await self.source.stop()

    async def pull(self, src_blocks: list[int], dst_blocks: list[int], timeout_s: float = 20) -> Any:
        dst = make_cache(LAYOUT, 64)
        h = self.source.offer(None, src_blocks, len(src_blocks) * LAYOUT.block_size)
        await self.puller.pull(h, dst, dst_blocks, timeout_s=timeout_s)
        assert digest(self.cache, src_blocks) == digest(dst, dst_blocks)
        untouched = [b for b in range(64) if b not in dst_blocks]
        assert not any(dst.k[layer][untouched].any() for layer in range(LAYOUT.num_layers))
        return dst


@pytest.fixture
def nccl(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cupy.install(monkeypatch, one_gpu_per_rank=True)
    fake_cupy.STATS.clear()


async def test_the_communicator_is_made_when_the_pair_meets_never_per_pull(nccl: None) -> None:
    async with Pair("nccl") as pd:
        await pd.puller.meet(pd.source.address)
        assert fake_cupy.STATS["comms"] == 2  # one per rank, before any request
        for i in range(3):
            await pd.pull([2 * i, 2 * i + 1], [10 + i, 30 + i])
        assert fake_cupy.STATS["comms"] == 2 and pd.puller.peers.meetings_started == 1
        await pd.puller.meet(pd.source.address)  # idempotent
        assert fake_cupy.STATS["comms"] == 2 and pd.source.stats().pairs == 1


async def test_a_pull_never_sets_up_a_pair_within_its_deadline(nccl: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A first pull from an unknown source starts the meeting in the background; a communicator
    init slower than the pull's deadline fails that pull clearly, and the pair still comes up."""
    init = fake_cupy.FakeComm.__init__

    def slow_init(self: Any, ndev: int, commId: tuple[int, ...], rank: int) -> None:
        time.sleep(1.0)
        init(self, ndev, commId, rank)

    monkeypatch.setattr(fake_cupy.FakeComm, "__init__", slow_init)
    async with Pair("nccl") as pd:
        h = pd.source.offer(None, [1, 2], 2 * LAYOUT.block_size)
        with pytest.raises(TransferTimeout, match="still being set up"):
            await pd.puller.pull(h, make_cache(LAYOUT, 64), [3, 4], timeout_s=0.3)
        deadline = time.monotonic() + 20
        while pd.source.stats().pairs == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await pd.puller.meet(pd.source.address)  # the meeting the pull started: done, not restarted
        assert fake_cupy.STATS["comms"] == 2 and pd.puller.peers.meetings_started == 1
        await pd.pull([5, 6], [7, 8])  # the handle of the failed pull is still under its lease; another one moves
        assert fake_cupy.STATS["comms"] == 2


async def test_fragmented_destination_costs_a_bounded_number_of_sends(nccl: None) -> None:
    async with Pair("nccl") as pd:
        await pd.puller.meet(pd.source.address)
        fake_cupy.STATS.clear()
        src, dst = list(range(40, 56)), list(range(0, 32, 2))  # 16 blocks into every other block
        await pd.pull(src, dst)
        assert 0 < fake_cupy.STATS["send"] <= 2 * LAYOUT.num_layers, fake_cupy.STATS
        assert fake_cupy.STATS["recv"] == fake_cupy.STATS["send"]


@pytest.mark.parametrize("transport", ["nccl", "gloo"])
async def test_staging_memory_stays_within_max_inflight_bytes(
        transport: str, nccl: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A transfer many times the budget goes through in slices; neither side ever holds more."""
    monkeypatch.setattr(streams, "MAX_CHUNK_BYTES", 64 << 10)
    budget = 2 * (64 << 10)
    async with Pair(transport, inflight=budget) as pd:
        await pd.puller.meet(pd.source.address)
        fake_cupy.STATS.clear()
        src, dst = list(range(0, 40, 2)), list(range(63, 23, -2))  # 20 blocks, ~2 MB: 15x the budget
        assert len(src) * LAYOUT.block_nbytes > 10 * budget
        await asyncio.gather(pd.pull(src, dst), pd.pull([41, 43], [1, 3]))
        per_slice = (64 << 10) // BLOCK_LAYER_BYTES
        if transport == "nccl":  # 4 layers x ceil(20 / 2) slices, plus a layer per chunk for the small one
            assert fake_cupy.STATS["send"] == LAYOUT.num_layers * (-(-len(src) // per_slice) + 1)
        for pool in (pd.source._pool, pd.puller.staging):
            assert 0 < pool.peak_bytes <= budget
            assert pool.lent_bytes == 0


def test_a_budget_below_one_chunk_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match="max_inflight_bytes"):
        KVPuller(SECRET, LAYOUT, PullerConfig(host="127.0.0.1", transport="gloo", max_inflight_bytes=1 << 20))


async def test_a_pull_on_a_connection_without_a_pair_is_refused_naming_pair(nccl: None) -> None:
    """The source never sets a pair up inside a PULL: without PAIR first it refuses, and the
    handle stays pullable on a connection that has its pair."""
    async with Pair("nccl") as pd:
        h = pd.source.offer(None, [1, 2], 2 * LAYOUT.block_size)
        loop = asyncio.get_running_loop()
        conn = await pd.puller.peers.connect(pd.source.address, loop.time() + 10)  # authenticated, unpaired
        try:
            await send_message(conn.writer, Pull(h.transfer_id, LAYOUT, 2, "nccl"), timeout_s=5)
            with pytest.raises(TransferRefused, match="PAIR"):
                await pd.puller.peers.recv(conn, loop.time() + 10)
        finally:
            conn.writer.close()
        assert fake_cupy.STATS["comms"] == 0 and pd.source.outbox.pending() == 1
        await pd.pull([5, 6], [7, 9])
        await pd.puller.pull(h, make_cache(LAYOUT, 64), [3, 4])
        assert fake_cupy.STATS["comms"] == 2
