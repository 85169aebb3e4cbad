"""The KVTransport contract, one test body for every transport (the fakes must not drift from gloo).

Both ends of a pair run in threads of this process; the two-process runs are in test_kvt_processes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import torch

from kv_transfer.errors import TransferError, TransferTimeout, TransportUnavailable
from kv_transfer.transport import DEST_RANK, SOURCE_RANK, KVTransport, available_transports, make_transport

pytestmark = pytest.mark.timeout(60)

CPU_TRANSPORTS = ["local", "local-direct", "gloo"]
#: nccl's own code over a CPU stand-in for cupy (tests/support/fake_cupy.py); the real one runs in the gpu tests.
CONTRACT = [*CPU_TRANSPORTS, "nccl-on-fake-cupy"]
POOL = ThreadPoolExecutor(max_workers=4, thread_name_prefix="contract")


def both(f0: Callable[[], object], f1: Callable[[], object], timeout_s: float = 30) -> tuple[object, object]:
    """Run the two ends concurrently; return each one's result or exception."""
    futs: list[Future[object]] = [POOL.submit(f0), POOL.submit(f1)]
    out = []
    for f in futs:
        exc = f.exception(timeout=timeout_s)
        out.append(exc if exc is not None else f.result())
    return out[0], out[1]


def fake_nccl(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.support import fake_cupy

    fake_cupy.install(monkeypatch)


@pytest.fixture(params=CONTRACT)
def pair(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[KVTransport, KVTransport]]:
    name = request.param
    if name == "nccl-on-fake-cupy":
        fake_nccl(monkeypatch)
        name = "nccl"
    src = make_transport(name, SOURCE_RANK, host="127.0.0.1", timeout_s=10)
    dst = make_transport(name, DEST_RANK, host="127.0.0.1", timeout_s=10)
    if name == "nccl":
        dst.device = "other-host/0000:01:00.0"  # type: ignore[attr-defined]  # two GPUs, as NCCL needs
    offer = src.offer(dst.local_info())
    r = both(lambda: src.open(offer, 10), lambda: dst.open(offer, 10))
    assert r == (None, None), r
    assert src.is_open and dst.is_open
    yield src, dst
    src.close()
    dst.close()


def payload(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(30, 2, 5, 16, 3, 64, generator=g),  # fp32, a SmolLM2-shaped staging tensor
        torch.randn(7, 16, 3, 64, generator=g).to(torch.bfloat16),
        torch.randn(1, 16, 3, 64, generator=g).to(torch.float16),
        # every bit pattern, NaNs and denormals included: nothing may be "normalized" on the way
        torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16),
    ]


def test_bytes_arrive_identical_over_repeated_transfers(pair: tuple[KVTransport, KVTransport]) -> None:
    src, dst = pair
    for seed in range(3):
        sent = payload(seed)
        into = [torch.empty_like(t) for t in sent]
        r = both(lambda: src.send(sent, 10), lambda: dst.recv(into, 10))  # noqa: B023 (run at once)
        assert r == (None, None), r
        for a, b in zip(sent, into, strict=True):
            assert a.dtype == b.dtype
            assert torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8))


def test_views_into_a_larger_tensor(pair: tuple[KVTransport, KVTransport]) -> None:
    src, dst = pair
    cache = torch.zeros(10, 16, 3, 64)
    sent = [torch.randn(3, 16, 3, 64), torch.randn(2, 16, 3, 64)]
    into = [cache[2:5], cache[7:9]]  # like direct receives into runs of blocks
    assert both(lambda: src.send(sent, 10), lambda: dst.recv(into, 10)) == (None, None)
    assert torch.equal(cache[2:5], sent[0]) and torch.equal(cache[7:9], sent[1])
    assert not cache[:2].any() and not cache[5:7].any() and not cache[9:].any()


class FakeStream:
    """``count`` chunks through ``window`` slots; fill writes chunk i's data, drain records it."""

    def __init__(self, chunks: list[torch.Tensor], window: int) -> None:
        self.chunks, self.count, self.window = chunks, len(chunks), window
        self.slots = [torch.empty_like(chunks[0]) for _ in range(window)]
        self.drained: list[torch.Tensor] = []

    def buffer(self, i: int) -> torch.Tensor:
        return self.slots[i % self.window]

    def fill(self, i: int) -> None:
        self.buffer(i).copy_(self.chunks[i])

    def drain(self, i: int) -> None:
        self.drained.append(self.buffer(i).clone())


@pytest.mark.parametrize("count,window", [(30, 4), (3, 4), (1, 1), (7, 2)])
def test_streams_arrive_identical_in_order(pair: tuple[KVTransport, KVTransport], count: int, window: int) -> None:
    src, dst = pair
    chunks = [torch.randn(2, 3, 16, 3, 64).to(torch.bfloat16) for _ in range(count)]
    out = FakeStream([torch.empty_like(chunks[0])] * count, window)
    r = both(lambda: src.send_stream(FakeStream(chunks, window), 10), lambda: dst.recv_stream(out, 10))
    assert r == (None, None), r
    assert len(out.drained) == count
    assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(chunks, out.drained, strict=True))


def test_recv_without_sender_times_out(pair: tuple[KVTransport, KVTransport]) -> None:
    _, dst = pair
    t0 = time.monotonic()
    with pytest.raises(TransferTimeout):
        dst.recv([torch.empty(8)], 0.5)
    assert time.monotonic() - t0 < 5
    assert not dst.is_open  # a failed pair is unusable


def test_size_mismatch_fails_both_ends(pair: tuple[KVTransport, KVTransport]) -> None:
    src, dst = pair
    r = both(lambda: src.send([torch.ones(100)], 1), lambda: dst.recv([torch.empty(50)], 1))
    assert all(isinstance(x, TransferError) for x in r), r


def test_close_wakes_the_peer(request: pytest.FixtureRequest, pair: tuple[KVTransport, KVTransport]) -> None:
    """A socket transport's peer is woken by the close; an NCCL peer is told nothing (aborting a
    communicator is local), so its own deadline ends the wait: TransferTimeout, not a hang."""
    src, dst = pair
    nccl = request.node.callspec.params["pair"] == "nccl-on-fake-cupy"
    fut = POOL.submit(dst.recv, [torch.empty(8)], 2.0 if nccl else 60.0)
    time.sleep(0.2)
    src.close()
    src.close()  # idempotent
    err = fut.exception(timeout=30)
    if nccl:
        assert isinstance(err, TransferTimeout), repr(err)
    else:  # woken by the close, not by its own deadline
        assert isinstance(err, TransferError) and not isinstance(err, TransferTimeout), repr(err)
    assert not src.is_open


def test_non_contiguous_is_refused(pair: tuple[KVTransport, KVTransport]) -> None:
    src, _ = pair
    with pytest.raises(ValueError, match="contiguous"):
        src.send([torch.randn(4, 4).t()], 1)


def test_open_without_peer_times_out() -> None:
    for name in CPU_TRANSPORTS:
        src = make_transport(name, SOURCE_RANK, host="127.0.0.1", timeout_s=5)
        offer = src.offer(make_transport(name, DEST_RANK, host="127.0.0.1", timeout_s=5).local_info())
        t0 = time.monotonic()
        with pytest.raises(TransferError):
            src.open(offer, 0.3)
        assert time.monotonic() - t0 < 5, name
        src.close()


def test_registry() -> None:
    names = available_transports()
    assert {"gloo", "local", "local-direct"} <= set(names)
    assert ("nccl" in names) == _nccl_usable()
    with pytest.raises(TransportUnavailable, match="unknown"):
        make_transport("carrier-pigeon", SOURCE_RANK, host="127.0.0.1", timeout_s=1)


def _nccl_usable() -> bool:
    from kv_transfer.nccl import NcclTransport

    return NcclTransport.is_available()


def test_nccl_unavailable_is_a_clear_startup_error() -> None:
    if _nccl_usable():
        pytest.skip("needs a machine without NCCL (cupy + a GPU): this checks the error where it is missing")
    with pytest.raises(TransportUnavailable, match="nccl"):
        make_transport("nccl", SOURCE_RANK, host="127.0.0.1", timeout_s=1)


class SyncedStream(FakeStream):
    """On a GPU a chunk is complete once its copy kernel ran: sync as `GatherStream` / `ScatterStream` do."""

    def fill(self, i: int) -> None:
        super().fill(i)
        torch.cuda.synchronize(self.slots[0].device)

    def drain(self, i: int) -> None:
        super().drain(i)
        torch.cuda.synchronize(self.slots[0].device)


@pytest.mark.gpu
def test_nccl_contract_across_two_gpus() -> None:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs: NCCL refuses two ranks on one GPU")

    def end(rank: int) -> KVTransport:
        torch.cuda.set_device(rank)
        return make_transport("nccl", rank, host="127.0.0.1", timeout_s=30)

    src, dst = both(lambda: end(SOURCE_RANK), lambda: end(DEST_RANK))
    assert isinstance(src, KVTransport) and isinstance(dst, KVTransport)
    offer = src.offer(dst.local_info())
    assert both(lambda: src.open(offer, 30), lambda: dst.open(offer, 30)) == (None, None)
    sent = [t.to("cuda:0") for t in payload(1)]
    into = [torch.empty_like(t, device="cuda:1") for t in sent]
    assert both(lambda: src.send(sent, 30), lambda: dst.recv(into, 30)) == (None, None)
    for a, b in zip(sent, into, strict=True):
        assert torch.equal(a.cpu().view(-1).view(torch.uint8), b.cpu().view(-1).view(torch.uint8))
    chunks = [torch.randn(2, 3, 16, 3, 64, device="cuda:0").to(torch.bfloat16) for _ in range(9)]
    out = SyncedStream([torch.empty_like(chunks[0], device="cuda:1")] * 9, 3)
    r = both(lambda: src.send_stream(SyncedStream(chunks, 4), 30), lambda: dst.recv_stream(out, 30))
    assert r == (None, None), r
    assert all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(chunks, out.drained, strict=True))
    src.close()
    dst.close()


def test_nccl_refuses_two_ranks_on_one_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from kv_transfer.errors import TransferRefused

    if not _nccl_usable():
        fake_nccl(monkeypatch)
    src = make_transport("nccl", SOURCE_RANK, host="127.0.0.1", timeout_s=5)
    dst = make_transport("nccl", DEST_RANK, host="127.0.0.1", timeout_s=5)
    with pytest.raises(TransferRefused, match="colocated"):
        src.offer(dst.local_info())
