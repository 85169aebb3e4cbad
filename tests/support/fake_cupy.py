"""A CPU stand-in for the slice of ``cupy`` / ``cupy.cuda.nccl`` that `kv_transfer.nccl` uses.

It moves real bytes between the pointers it is handed (``ctypes.memmove``), with NCCL's shape:
``groupEnd`` only enqueues; completion is observed through an ``Event`` recorded on the stream;
a send completes when its receiver took the bytes; mismatched sizes put both communicators in an
async-error state (``check_async_error`` raises); ``abort`` ends a communicator. So the transport's
calls (pointers, byte counts, datatype, peer, stream, grouping, polling, uid round trip) run on a
machine without a GPU; the real thing runs in the ``gpu``-marked tests.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from collections import deque
from types import SimpleNamespace
from typing import Any

NCCL_UINT8 = 1
_LOCK = threading.Condition()
_WORLDS: dict[bytes, _World] = {}
_STREAMS: dict[int, _Stream] = {}
_GROUP = threading.local()


class NcclError(RuntimeError):
    pass


class _World:
    def __init__(self) -> None:
        self.members: dict[int, FakeComm] = {}
        self.sends: dict[tuple[int, int], deque[_Op]] = {}
        self.error: str | None = None


class _Op:
    def __init__(self, kind: str, comm: FakeComm, ptr: int, count: int, peer: int) -> None:
        self.kind, self.comm, self.ptr, self.count, self.peer = kind, comm, ptr, count, peer
        self.done = False


class _Stream:
    def __init__(self) -> None:
        self.ops: list[_Op] = []
        self.ptr = id(self)
        _STREAMS[self.ptr] = self


def _progress(world: _World) -> None:
    """Match posted receives with queued sends (lock held)."""
    for comm in world.members.values():
        for stream in _STREAMS.values():
            for op in stream.ops:
                if op.kind != "recv" or op.done or op.comm is not comm:
                    continue
                q = world.sends.get((op.peer, comm.rank))
                if not q:
                    continue
                send = q.popleft()
                if send.count != op.count:
                    world.error = f"size mismatch: sent {send.count} bytes, receiving {op.count}"
                    return
                ctypes.memmove(op.ptr, send.ptr, op.count)
                op.done = send.done = True


class FakeComm:
    def __init__(self, ndev: int, uid: bytes, rank: int) -> None:
        if not isinstance(uid, bytes) or len(uid) != 128:
            raise TypeError("commId must be 128 bytes")
        self.rank = rank
        self.aborted = False
        deadline = time.monotonic() + 10
        with _LOCK:
            self.world = _WORLDS.setdefault(uid, _World())
            self.world.members[rank] = self
            _LOCK.notify_all()
            while len(self.world.members) < ndev:  # ncclCommInitRank blocks for every rank
                if not _LOCK.wait(deadline - time.monotonic()):
                    raise NcclError("init timed out")

    def _enqueue(self, kind: str, ptr: int, count: int, datatype: int, peer: int, stream: int) -> None:
        assert datatype == NCCL_UINT8 and isinstance(ptr, int) and ptr and count > 0
        ops = getattr(_GROUP, "ops", None)
        if ops is None:
            raise NcclError("p2p call outside groupStart/groupEnd")
        ops.append((_Op(kind, self, ptr, count, peer), stream))

    def send(self, ptr: int, count: int, datatype: int, peer: int, stream: int) -> None:
        self._enqueue("send", ptr, count, datatype, peer, stream)

    def recv(self, ptr: int, count: int, datatype: int, peer: int, stream: int) -> None:
        self._enqueue("recv", ptr, count, datatype, peer, stream)

    def check_async_error(self) -> None:
        with _LOCK:
            if self.aborted:
                raise NcclError("communicator aborted")
            if self.world.error:
                raise NcclError(self.world.error)

    def abort(self) -> None:
        self.aborted = True

    def destroy(self) -> None:
        self.aborted = True


def groupStart() -> None:
    _GROUP.ops = []


def groupEnd() -> None:
    ops, _GROUP.ops = _GROUP.ops, None
    with _LOCK:
        for op, stream_ptr in ops:
            _STREAMS[stream_ptr].ops.append(op)
            if op.kind == "send":
                op.comm.world.sends.setdefault((op.comm.rank, op.peer), deque()).append(op)
        _LOCK.notify_all()


def get_unique_id() -> bytes:
    return os.urandom(128)


class _Event:
    def __init__(self, disable_timing: bool = False) -> None:
        self._ops: list[_Op] = []

    def record(self, stream: _Stream) -> None:
        self._ops = list(stream.ops)

    @property
    def done(self) -> bool:
        with _LOCK:
            for op in self._ops:
                _progress(op.comm.world)
            return all(op.done for op in self._ops)


class _Device:
    def __init__(self, index: int) -> None:
        self.pci_bus_id = f"0000:{index:02x}:00.0"

    def __enter__(self) -> _Device:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def modules() -> tuple[Any, Any]:
    """``(cupy, cupy.cuda.nccl)`` look-alikes."""
    nccl = SimpleNamespace(available=True, NCCL_UINT8=NCCL_UINT8, NcclCommunicator=FakeComm,
                           groupStart=groupStart, groupEnd=groupEnd, get_unique_id=get_unique_id)
    cuda = SimpleNamespace(is_available=lambda: True, Device=_Device, Event=_Event,
                           Stream=lambda non_blocking=False: _Stream())
    return SimpleNamespace(cuda=cuda), nccl
