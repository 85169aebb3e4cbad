"""KVSource ↔ KVPuller in one process (local transports and gloo): protocol, refusals, failures.

The same pair of classes across real OS processes is in test_kvt_processes.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import struct
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence

import pytest
import torch

from kv_transfer.client import KVPuller, PullerConfig
from kv_transfer.errors import AuthError, TransferError, TransferRefused, TransferTimeout
from kv_transfer.handle import KVHandle
from kv_transfer.local import LocalTransport
from kv_transfer.outbox import Outbox
from kv_transfer.server import KVSource, SourceConfig
from kv_transfer.transport import register_transport
from tests.support.kv_caches import SECRET, SMOL, digest, make_cache

pytestmark = pytest.mark.timeout(60)
LAYOUT = dataclasses.replace(SMOL, num_layers=4)  # small: these tests are about the protocol


class Source:
    def __init__(self, transport: str, num_blocks: int = 64, **cfg: object) -> None:
        self.cache = make_cache(LAYOUT, num_blocks, seed=1)
        self.freed: Counter[int] = Counter()
        self.outbox = Outbox(lambda b: self.freed.update(b), default_lease_s=30)
        config = SourceConfig(host="127.0.0.1", transport=transport, expire_interval_s=0.05, **cfg)  # type: ignore[arg-type]
        self.server = KVSource(self.cache, self.outbox, SECRET, LAYOUT, config)


def puller(transport: str, secret: bytes = SECRET) -> KVPuller:
    return KVPuller(secret, LAYOUT, PullerConfig(host="127.0.0.1", transport=transport))


@pytest.fixture
async def gloo_source() -> AsyncIterator[Source]:
    src = Source("gloo")
    await src.server.start()
    yield src
    await src.server.stop()


async def check_pull(src: Source, p: KVPuller, src_blocks: Sequence[int], dst_blocks: Sequence[int],
                     n_tokens: int, dst_cache: object | None = None) -> None:
    dst = dst_cache or make_cache(LAYOUT, 64)
    h = src.server.offer(None, list(src_blocks), n_tokens)
    stats = await p.pull(h, dst, list(dst_blocks), timeout_s=20)  # type: ignore[arg-type]
    n = h.n_blocks
    assert stats.nbytes == n * LAYOUT.block_nbytes and stats.n_blocks == n
    assert digest(src.cache, src_blocks[:n]) == digest(dst, dst_blocks[:n])  # type: ignore[arg-type]
    assert all(src.freed[b] == 1 for b in src_blocks)


@pytest.mark.parametrize("transport", ["local", "local-direct", "gloo"])
async def test_pull_is_byte_exact_and_reuses_the_pair(transport: str) -> None:
    src = Source(transport)
    await src.server.start()
    p = puller(transport)
    try:
        # partial last block; scattered destination ids (several runs for the direct mode)
        await check_pull(src, p, [3, 4, 5, 9, 10], [40, 41, 7, 8, 20], n_tokens=70)
        await check_pull(src, p, list(range(20, 30)), list(range(63, 53, -1)), n_tokens=160)
        await check_pull(src, p, [0], [0], n_tokens=1)
        s = src.server.stats()
        assert s.transfers == 3 and s.refused == 0 and s.failed == 0 and s.connections == 1
        src.outbox.check_empty()
    finally:
        await p.close()
        await src.server.stop()


async def test_concurrent_pulls_on_one_pair(gloo_source: Source) -> None:
    p = puller("gloo")
    dst = make_cache(LAYOUT, 64)
    try:
        handles = [gloo_source.server.offer(None, [4 * i, 4 * i + 1, 4 * i + 2], 40) for i in range(8)]
        stats = await asyncio.gather(*(p.pull(h, dst, [60 - 3 * i, 59 - 3 * i, 58 - 3 * i], timeout_s=30)
                                       for i, h in enumerate(handles)))
        assert len(stats) == 8
        for i in range(8):
            assert digest(gloo_source.cache, [4 * i, 4 * i + 1, 4 * i + 2]) == \
                digest(dst, [60 - 3 * i, 59 - 3 * i, 58 - 3 * i])
        gloo_source.outbox.check_empty()
    finally:
        await p.close()


async def test_layout_mismatch_refused_by_the_source_naming_the_field(gloo_source: Source) -> None:
    other = dataclasses.replace(LAYOUT, dtype="bfloat16")
    p = KVPuller(SECRET, other, PullerConfig(host="127.0.0.1", transport="gloo"))
    try:
        h = gloo_source.server.offer(None, [1, 2], 20)
        lying = dataclasses.replace(h, layout=other)  # skips the puller's local check
        with pytest.raises(TransferRefused, match="dtype") as ei:
            await p.pull(lying, make_cache(other, 8), [0, 1])
        assert "float32" in ei.value.reason and "bfloat16" in ei.value.reason
        # the local check catches an honest handle without a round trip
        with pytest.raises(TransferRefused, match="dtype"):
            await p.pull(h, make_cache(other, 8), [0, 1])
        assert gloo_source.outbox.pending() == 1  # refused pulls leave the lease alone
    finally:
        await p.close()


async def test_refusals_keep_the_connection_usable(gloo_source: Source) -> None:
    p = puller("gloo")
    dst = make_cache(LAYOUT, 8)
    try:
        h = gloo_source.server.offer(None, [1, 2], 20, lease_s=0.05)
        await asyncio.sleep(0.2)
        with pytest.raises(TransferRefused, match="expired"):
            await p.pull(h, dst, [0, 1])
        assert gloo_source.freed[1] == 1  # the lease freed it
        with pytest.raises(TransferRefused, match="unknown"):
            await p.pull(dataclasses.replace(h, transfer_id="never-offered"), dst, [0, 1])
        h2 = gloo_source.server.offer(None, [5, 6], 20)
        await p.release(h2)
        assert gloo_source.freed[5] == 1 and gloo_source.outbox.pending() == 0
        with pytest.raises(TransferRefused, match="released"):
            await p.pull(h2, dst, [0, 1])
        await check_pull(gloo_source, p, [10, 11], [2, 3], 32, dst_cache=dst)
        s = gloo_source.server.stats()
        assert s.connections == 1 and s.refused == 3 and s.outbox.expired == 1 and s.outbox.released == 1
    finally:
        await p.close()


async def test_wrong_secret_is_refused_and_others_still_served(gloo_source: Source) -> None:
    bad = puller("gloo", secret=b"not-the-cluster-secret-at-all!!!")
    good = puller("gloo")
    try:
        h = gloo_source.server.offer(None, [1], 10)
        with pytest.raises(AuthError, match="secret"):
            await bad.pull(h, make_cache(LAYOUT, 4), [0])
        assert gloo_source.server.stats().auth_failures == 1
        assert gloo_source.outbox.pending() == 1
        await check_pull(gloo_source, good, [2, 3], [0, 1], 30)
    finally:
        await bad.close()
        await good.close()


async def test_garbage_and_huge_frames_are_dropped(gloo_source: Source) -> None:
    host, port = gloo_source.server.address
    for junk in (b"GET / HTTP/1.1\r\n\r\n", struct.pack(">I", 0xFFFFFFF0), b"\x00\x00\x00\x03\xc1\xc1\xc1"):
        r, w = await asyncio.open_connection(host, port)
        w.write(junk)
        await w.drain()
        data = await asyncio.wait_for(r.read(), 5)  # the server answers (challenge, error) and closes
        assert len(data) < 5000
        w.close()
    p = puller("gloo")
    try:
        await check_pull(gloo_source, p, [7], [7], 5)
    finally:
        await p.close()


async def test_silent_server_times_out_within_the_deadline() -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(4)  # accepts (in the kernel) and never says a word
    h = KVHandle("t-silent", "127.0.0.1", sock.getsockname()[1], 10, LAYOUT, time.time() + 30)
    p = puller("gloo")
    t0 = time.monotonic()
    try:
        with pytest.raises(TransferTimeout):
            await p.pull(h, make_cache(LAYOUT, 4), [0], timeout_s=0.5)
        assert time.monotonic() - t0 < 3
    finally:
        await p.close()
        sock.close()


async def test_dead_source_fails_fast_and_stale_connections_recover() -> None:
    src = Source("gloo", idle_timeout_s=0.2)
    await src.server.start()
    p = puller("gloo")
    try:
        await check_pull(src, p, [1], [1], 10)
        await asyncio.sleep(0.5)  # the source closes the idle connection; the puller's cache is stale
        await check_pull(src, p, [2], [2], 10)
        h = src.server.offer(None, [3], 10)
        await src.server.stop()
        with pytest.raises(TransferError) as failed:
            await p.pull(h, make_cache(LAYOUT, 4), [0], timeout_s=60)
        assert not isinstance(failed.value, TransferTimeout), repr(failed.value)  # refused, not waited out
        assert src.freed[3] == 1  # stop() released what was pending
    finally:
        await p.close()


class StallingTransport(LocalTransport):
    """A local transport whose source stalls before sending (a hung or overloaded peer)."""

    name = "local-stall"
    stall_s = 4.0  # far beyond the pull's 0.2 s: giving up must not wait for it

    def send(self, tensors: Sequence[torch.Tensor], timeout_s: float) -> None:
        time.sleep(self.stall_s)
        super().send(tensors, timeout_s)


register_transport(StallingTransport)


@pytest.mark.parametrize("how", ["timeout", "cancel"])
async def test_timed_out_or_cancelled_pull_leaves_nothing_hanging(how: str) -> None:
    src = Source("local-stall")
    await src.server.start()
    p = puller("local-stall")
    dst = make_cache(LAYOUT, 8)
    try:
        h = src.server.offer(None, [1, 2], 20)
        t0 = time.monotonic()
        if how == "timeout":
            with pytest.raises(TransferTimeout):
                await p.pull(h, dst, [0, 1], timeout_s=0.2)
        else:
            task = asyncio.create_task(p.pull(h, dst, [0, 1], timeout_s=10))
            await asyncio.sleep(0.2)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        assert time.monotonic() - t0 < 2.5  # gave up, not waited out the 4 s stall
        assert not dst.k[0].any()  # nothing written after the pull gave up
        # the source notices (once its stalled send returns), requeues under the lease; a retry on a
        # fresh pair gets the data
        StallingTransport.stall_s = 0.0
        deadline = time.monotonic() + 30
        while src.server.stats().failed == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        s = src.server.stats()
        assert s.failed == 1 and s.outbox.pending == 1 and s.outbox.in_flight == 0
        await p.pull(h, dst, [0, 1], timeout_s=10)
        assert digest(src.cache, [1, 2]) == digest(dst, [0, 1])
        src.outbox.check_empty()
        assert not dst.k[0][2:].any()
    finally:
        StallingTransport.stall_s = 4.0
        await p.close()
        await src.server.stop()


async def test_same_gpu_nccl_pair_is_refused_through_the_protocol(monkeypatch: pytest.MonkeyPatch) -> None:
    import kv_transfer.nccl as nccl_mod
    from tests.support import fake_cupy

    monkeypatch.setattr(nccl_mod, "_cupy", fake_cupy.modules)
    monkeypatch.setattr(nccl_mod, "_current_device", lambda: torch.device("cpu"))
    src = Source("nccl")
    await src.server.start()
    p = puller("nccl")
    try:
        h = src.server.offer(None, [1], 10)
        with pytest.raises(TransferRefused, match="colocated"):
            await p.pull(h, make_cache(LAYOUT, 4), [0])
        assert src.outbox.pending() == 1 and src.outbox.stats().in_flight == 0
    finally:
        await p.close()
        await src.server.stop()


async def test_bad_block_ids_are_caller_errors(gloo_source: Source) -> None:
    p = puller("gloo")
    try:
        h = gloo_source.server.offer(None, [1, 2], 20)
        dst = make_cache(LAYOUT, 8)
        with pytest.raises(ValueError, match="need 2"):
            await p.pull(h, dst, [0])
        with pytest.raises(ValueError, match="distinct"):
            await p.pull(h, dst, [0, 0])
        with pytest.raises(ValueError, match="range"):
            await p.pull(h, dst, [0, 8])
        with pytest.raises(ValueError):
            gloo_source.server.offer(None, [1], 20)  # 20 tokens need 2 blocks
    finally:
        await p.close()
