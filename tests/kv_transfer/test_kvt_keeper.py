"""`SourceKeeper` through `KVPuller.meet_sources`: a decode side told the prefill pool's sources meets
them all before any request, forgets those that leave, and retries those that fail without holding
up the others. The pure planner and backoff are tested on their own first.

The pairs run the nccl transport on the fake cupy (tests/support/fake_cupy.py, held to real cupy's
contract in test_kvt_cupy_api.py), so a communicator count is the real code path's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import time
from collections.abc import AsyncIterator, Callable

import pytest

from kv_transfer.client import KVPuller, PullerConfig
from kv_transfer.keeper import Backoff, SourceBook, SourceKeeper, plan
from kv_transfer.outbox import Outbox
from kv_transfer.server import KVSource, SourceConfig
from tests.support import fake_cupy
from tests.support.kv_caches import SECRET, SMOL, digest, make_cache

pytestmark = pytest.mark.timeout(60)
LAYOUT = dataclasses.replace(SMOL, num_layers=2)
A, B, C = ("10.0.0.1", 1), ("10.0.0.2", 2), ("10.0.0.3", 3)


# --- pure: what to do, and when to try again ----------------------------------------------------

def test_plan_meets_the_new_and_the_lost_and_forgets_the_gone() -> None:
    books = {A: SourceBook(), B: SourceBook(), C: SourceBook()}
    todo = plan({A, B, ("10.0.0.4", 4)}, books, paired={A}, meeting=set(), now=0.0)
    assert todo.meet == (B, ("10.0.0.4", 4))  # B is listed but its pair is gone: met again
    assert todo.forget == (C,)


def test_plan_waits_out_a_backoff_and_never_doubles_a_meeting() -> None:
    books = {A: SourceBook(failures=2, retry_at=10.0), B: SourceBook()}
    assert plan({A, B}, books, paired=set(), meeting={B}, now=9.9).meet == ()
    assert plan({A, B}, books, paired=set(), meeting={B}, now=10.0).meet == (A,)


def test_backoff_doubles_from_the_first_failure_up_to_its_cap() -> None:
    b = Backoff(first_s=0.5, max_s=3.0)
    assert [b.delay(n) for n in range(6)] == [0.0, 0.5, 1.0, 2.0, 3.0, 3.0]


# --- the keeper on real pairs (nccl on the fake cupy) --------------------------------------------

class Src:
    def __init__(self, port: int = 0) -> None:
        self.cache = make_cache(LAYOUT, 16, seed=port or 3)
        self.outbox = Outbox(lambda b: None, default_lease_s=30)
        self.server = KVSource(self.cache, self.outbox, SECRET, LAYOUT,
                               SourceConfig(host="127.0.0.1", port=port, transport="nccl"))


@pytest.fixture
def nccl(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_cupy.install(monkeypatch, one_gpu_per_rank=True)
    fake_cupy.STATS.clear()


@pytest.fixture
async def two(nccl: None) -> AsyncIterator[tuple[KVPuller, Src, Src]]:
    a, b = Src(), Src()
    await a.server.start()
    await b.server.start()
    puller = KVPuller(SECRET, LAYOUT, PullerConfig(host="127.0.0.1", transport="nccl", pair_timeout_s=20))
    try:
        yield puller, a, b
    finally:
        await puller.close()
        await a.server.stop()
        await b.server.stop()


async def until(cond: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"never: {what}"
        await asyncio.sleep(0.02)


async def test_sources_told_before_any_request_are_all_met_and_the_first_pulls_wait_for_nothing(
        two: tuple[KVPuller, Src, Src]) -> None:
    puller, a, b = two
    todo = puller.meet_sources([a.server.address, b.server.address])  # returns at once: meetings run behind
    assert set(todo.meet) == {a.server.address, b.server.address}
    await until(lambda: puller.pair_stats().paired == 2, "both pairs up")
    assert fake_cupy.STATS["comms"] == 4  # one communicator per rank per pair, before any request
    for src in (a, b):
        h = src.server.offer(None, [1, 2], 2 * LAYOUT.block_size)
        dst = make_cache(LAYOUT, 16)
        await puller.pull(h, dst, [5, 6], timeout_s=10)
        assert digest(src.cache, [1, 2]) == digest(dst, [5, 6])
    assert fake_cupy.STATS["comms"] == 4 and puller.peers.meetings_started == 2
    assert puller.pulls_unpaired == 0  # neither pull found its source unmet
    assert puller.meet_sources([a.server.address, b.server.address]).meet == ()  # nothing new to do


async def test_a_source_that_leaves_the_set_has_its_pair_closed(two: tuple[KVPuller, Src, Src]) -> None:
    puller, a, b = two
    puller.meet_sources([a.server.address, b.server.address])
    await until(lambda: puller.pair_stats().paired == 2, "both pairs up")
    assert puller.meet_sources([a.server.address]).forget == (b.server.address,)
    await until(lambda: b.server.stats().connections == 0, "b's connection closed by the puller")
    assert puller.peers.paired(b.server.address) is None
    assert puller.peers.paired(a.server.address) is not None and puller.pair_stats().listed == 1


async def test_a_silent_and_a_refusing_source_hold_up_no_other_and_are_retried(
        two: tuple[KVPuller, Src, Src]) -> None:
    puller, a, _ = two
    silent = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)  # accepts, never says a word
    with socket.socket() as s:  # a port nobody listens on: connection refused
        s.bind(("127.0.0.1", 0))
        refusing = ("127.0.0.1", s.getsockname()[1])
    silent_addr = ("127.0.0.1", silent.sockets[0].getsockname()[1])
    try:
        puller.meet_sources([silent_addr, refusing, a.server.address])
        await until(lambda: puller.peers.paired(a.server.address) is not None, "a paired")
        assert puller.peers.is_meeting(silent_addr)  # still waiting on the silent one, a did not
        await until(lambda: puller.pair_stats().failing >= 1, "the refused meeting counted")
        assert puller.meet_sources([silent_addr, refusing, a.server.address]).meet == ()  # backing off
        eager = SourceKeeper(puller.peers, Backoff(first_s=0.0))  # a backoff that has always passed
        for tries in (1, 2):
            assert eager.update([refusing]).meet == (refusing,)
            await until(lambda: eager.stats().failing == 1 and not puller.peers.is_meeting(refusing),
                        f"refused try {tries} settled")
        assert puller.peers.paired(a.server.address) is not None
    finally:
        silent.close()


async def test_a_restarted_source_on_the_same_address_is_met_again(two: tuple[KVPuller, Src, Src]) -> None:
    puller, a, _ = two
    keeper = SourceKeeper(puller.peers)
    addr = a.server.address
    keeper.update([addr])
    await until(lambda: keeper.stats().paired == 1, "a paired")
    await a.server.stop()
    await until(lambda: puller.peers.paired(addr) is None, "the lost pair noticed")
    again = Src(port=addr[1])
    await again.server.start()
    try:
        assert again.server.address == addr
        assert keeper.update([addr]).meet == (addr,)
        await until(lambda: keeper.stats().paired == 1, "met again")
        assert again.server.stats().pairs == 1
    finally:
        await keeper.close()
        await again.server.stop()
