"""The slice of cupy's NCCL API that `kv_transfer.nccl` relies on, as one contract for the fake and real cupy.

The fake (tests/support/fake_cupy.py) runs here on CPU tensors; the same test bodies run against
real cupy on a GPU (``gpu``-marked), so the fake cannot drift from the library it stands in for.
One GPU suffices: a single-rank communicator sends to itself inside one group.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch


@dataclass(frozen=True)
class Cupy:
    cupy: Any
    nccl: Any
    device: torch.device


def _fake() -> Cupy:
    from tests.support import fake_cupy

    cupy, nccl = fake_cupy.modules()
    return Cupy(cupy, nccl, torch.device("cpu"))


def _real() -> Cupy:
    cupy = pytest.importorskip("cupy", reason="real cupy is not installed (pdserve[gpu] or pdserve[gpu-cu13])")
    from cupy.cuda import nccl

    if not getattr(nccl, "available", False):
        pytest.skip("cupy was built without NCCL")
    return Cupy(cupy, nccl, torch.device("cuda", torch.cuda.current_device()))


@pytest.fixture(params=[pytest.param(_fake, id="fake"), pytest.param(_real, id="real", marks=pytest.mark.gpu)])
def api(request: pytest.FixtureRequest) -> Cupy:
    make: Callable[[], Cupy] = request.param
    return make()


def _wait(api: Cupy, comm: Any, stream: Any) -> None:
    done = api.cupy.cuda.Event(disable_timing=True)
    done.record(stream)
    for _ in range(100_000):
        comm.check_async_error()
        if done.done:
            return
    raise AssertionError("the group never completed")


def test_unique_id_is_a_tuple_of_128_signed_chars(api: Cupy) -> None:
    uid = api.nccl.get_unique_id()
    assert isinstance(uid, tuple) and len(uid) == 128
    assert all(isinstance(c, int) and -128 <= c <= 127 for c in uid)
    assert api.nccl.get_unique_id() != uid


def test_communicator_takes_the_tuple_and_refuses_bytes(api: Cupy) -> None:
    uid = api.nccl.get_unique_id()
    with pytest.raises(TypeError):
        api.nccl.NcclCommunicator(1, bytes(c & 0xFF for c in uid), 0)
    with pytest.raises(TypeError):
        api.nccl.NcclCommunicator(1, list(uid), 0)
    with pytest.raises(AssertionError):
        api.nccl.NcclCommunicator(1, uid[:127], 0)
    with pytest.raises(TypeError):
        api.nccl.NcclCommunicator(1, uid)  # (ndev, commId, rank): all three
    comm = api.nccl.NcclCommunicator(1, uid, 0)
    comm.check_async_error()
    comm.abort()
    comm.abort()  # idempotent


def test_grouped_self_send_moves_bytes_and_groups_nest(api: Cupy) -> None:
    nccl = api.nccl
    comm = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
    stream = api.cupy.cuda.Stream(non_blocking=True)
    g = torch.Generator().manual_seed(0)
    sent = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).to(api.device) for n in (4096, 1, 333)]
    into = [torch.zeros_like(t) for t in sent]
    nccl.groupStart()
    nccl.groupStart()  # nested: ops are issued at the outermost groupEnd
    for t in sent:
        comm.send(t.data_ptr(), t.numel(), nccl.NCCL_UINT8, 0, stream.ptr)
    nccl.groupEnd()
    for t in into:
        comm.recv(t.data_ptr(), t.numel(), nccl.NCCL_UINT8, 0, stream.ptr)
    nccl.groupEnd()
    _wait(api, comm, stream)
    assert all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(sent, into, strict=True))
    comm.destroy()


def test_p2p_arguments_are_typed(api: Cupy) -> None:
    nccl = api.nccl
    comm = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
    stream = api.cupy.cuda.Stream(non_blocking=True)
    t = torch.zeros(8, dtype=torch.uint8, device=api.device)
    with pytest.raises(TypeError):
        comm.send(t, 8, nccl.NCCL_UINT8, 0, stream.ptr)  # a tensor is not a pointer
    with pytest.raises(TypeError):
        comm.send(t.data_ptr(), 8, nccl.NCCL_UINT8, 0, stream)  # nor is a stream object
    with pytest.raises(OverflowError):
        comm.recv(t.data_ptr(), -1, nccl.NCCL_UINT8, 0, stream.ptr)
    comm.abort()
