"""A CPU stand-in for the slice of ``cupy`` / ``cupy.cuda.nccl`` that `kv_transfer.nccl` uses.

It mirrors real cupy's signatures and types (``cupy_backends/cuda/libs/nccl.pyx``), so the branch
the transport takes here is the one it takes on a GPU:

- ``get_unique_id()`` returns a **tuple of 128 ints** in ``-128..127`` (``ncclUniqueId`` is
  ``char[128]``); ``NcclCommunicator(ndev, commId, rank)`` takes that tuple: anything else (bytes
  above all) raises ``TypeError`` as Cython's typed argument does, a wrong length ``AssertionError``,
  a value outside ``char`` ``OverflowError``; ``ndev``/``rank`` must be ints.
- ``send``/``recv(ptr, count, datatype, peer, stream_ptr)`` take ints only (``intptr_t``/``size_t``/
  ``int``); a negative count is an ``OverflowError``; ``peer`` must be a rank of the communicator.
- Group calls nest (``groupStart``/``groupEnd``); ops are issued at the outermost ``groupEnd``; a
  p2p call outside any group is a group of its own, as in NCCL 2.7+; ``groupEnd`` without a start
  is an ``NcclError``.
- ``abort()``/``destroy()`` are idempotent; any call on an aborted communicator raises ``NcclError``.

It moves real bytes between the pointers it is handed (``ctypes.memmove``) with NCCL's timing:
``groupEnd`` only enqueues; ops on a stream complete in order; a send completes when its receiver
took the bytes; completion is observed through an ``Event`` recorded on the stream; mismatched
sizes put the communicators in an async-error state (``check_async_error`` raises). The same
contract runs against real cupy in the ``gpu``-marked tests (tests/kv_transfer/test_kvt_cupy_api.py).

Test-only counters: ``STATS`` counts communicators made and p2p ops issued, so tests can bound them.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections import Counter, deque
from types import SimpleNamespace
from typing import Any

import numpy as np

NCCL_UINT8 = 1
NCCL_UNIQUE_ID_BYTES = 128
_DATATYPES = {0: 1, 1: 1, 2: 4, 3: 4, 4: 8, 5: 8, 6: 2, 7: 4, 8: 8, 9: 2}  # ncclDataType_t → bytes
_LOCK = threading.Condition()
_WORLDS: dict[tuple[int, ...], _World] = {}
_STREAMS: dict[int, _Stream] = {}
_GROUP = threading.local()
#: ``comms`` made, ``send`` / ``recv`` ops issued (test-only; reset it with ``STATS.clear()``).
STATS: Counter[str] = Counter()


class NcclError(RuntimeError):
    pass


class _World:
    def __init__(self, ndev: int) -> None:
        self.ndev = ndev
        self.members: dict[int, FakeComm] = {}
        self.sends: dict[tuple[int, int], deque[_Op]] = {}
        self.error: str | None = None


class _Op:
    def __init__(self, kind: str, comm: FakeComm, ptr: int, nbytes: int, peer: int) -> None:
        self.kind, self.comm, self.ptr, self.nbytes, self.peer = kind, comm, ptr, nbytes, peer
        self.done = False


class _Stream:
    def __init__(self, non_blocking: bool = False) -> None:
        self.groups: list[list[_Op]] = []  # in issue order; a group's ops run together
        self.ptr = id(self)
        _STREAMS[self.ptr] = self


def _progress(world: _World) -> None:
    """Complete what can complete (lock held): per stream, group after group, a receive takes the
    oldest send queued for it; a send completes when its receiver took it."""
    for stream in _STREAMS.values():
        while stream.groups and all(op.done for op in stream.groups[0]):
            stream.groups.pop(0)  # finished: events recorded before hold their own op lists
        for group in stream.groups:
            for op in group:
                if op.done or op.kind == "send" or op.comm.world is not world:
                    continue
                q = world.sends.get((op.peer, op.comm.rank))
                if not q:
                    continue
                send = q.popleft()
                if send.nbytes != op.nbytes:
                    world.error = f"size mismatch: sent {send.nbytes} bytes, receiving {op.nbytes}"
                    return
                ctypes.memmove(op.ptr, send.ptr, op.nbytes)
                op.done = send.done = True
            if not all(op.done for op in group):
                break  # later groups on this stream wait for this one (stream order)


def _int(name: str, value: object, lo: int = -(1 << 63)) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
        raise TypeError(f"an integer is required for {name}, got {type(value).__name__}")
    if value < lo:
        raise OverflowError(f"can't convert negative value to size_t ({name}={value})")
    return int(value)


class FakeComm:
    """``cupy.cuda.nccl.NcclCommunicator`` look-alike: ``(int ndev, tuple commId, int rank)``."""

    def __init__(self, ndev: int, commId: tuple[int, ...], rank: int) -> None:
        ndev, rank = _int("ndev", ndev), _int("rank", rank)
        if not isinstance(commId, tuple):
            raise TypeError(f"Argument 'commId' has incorrect type (expected tuple, got {type(commId).__name__})")
        assert len(commId) == NCCL_UNIQUE_ID_BYTES
        for c in commId:
            if not -128 <= _int("commId[i]", c) <= 127:
                raise OverflowError(f"value too large to convert to char: {c}")
        if not 0 <= rank < ndev:
            raise NcclError(f"NCCL_ERROR_INVALID_ARGUMENT: rank {rank} of {ndev}")
        self.rank = rank
        self._aborted = False
        deadline = time.monotonic() + 10
        with _LOCK:
            self.world = _WORLDS.setdefault(commId, _World(ndev))
            self.world.members[rank] = self
            STATS["comms"] += 1
            _LOCK.notify_all()
            while len(self.world.members) < ndev:  # ncclCommInitRank blocks for every rank
                if not _LOCK.wait(deadline - time.monotonic()):
                    raise NcclError("init timed out")

    def _live(self) -> None:
        if self._aborted:
            raise NcclError("NCCL_ERROR_INVALID_ARGUMENT: communicator was aborted or destroyed")

    def _enqueue(self, kind: str, ptr: int, count: int, datatype: int, peer: int, stream: int) -> None:
        ptr, count = _int("buf", ptr), _int("count", count, lo=0)
        datatype, peer, stream = _int("datatype", datatype), _int("peer", peer), _int("stream", stream)
        self._live()
        if datatype not in _DATATYPES or not 0 <= peer < self.world.ndev or not ptr:
            raise NcclError(f"NCCL_ERROR_INVALID_ARGUMENT: {kind}(datatype={datatype}, peer={peer})")
        op = (_Op(kind, self, ptr, count * _DATATYPES[datatype], peer), stream)
        STATS[kind] += 1
        if getattr(_GROUP, "depth", 0):
            _GROUP.ops.append(op)
        else:  # outside a group: a group of one
            _issue([op])

    def send(self, sendbuf: int, count: int, datatype: int, peer: int, stream: int) -> None:
        self._enqueue("send", sendbuf, count, datatype, peer, stream)

    def recv(self, recvbuf: int, count: int, datatype: int, peer: int, stream: int) -> None:
        self._enqueue("recv", recvbuf, count, datatype, peer, stream)

    def check_async_error(self) -> None:
        self._live()
        with _LOCK:
            if self.world.error:
                raise NcclError(f"NCCL_ERROR_INVALID_USAGE: {self.world.error}")

    def abort(self) -> None:
        self._aborted = True

    def destroy(self) -> None:
        self._aborted = True


def groupStart() -> None:
    if not getattr(_GROUP, "depth", 0):
        _GROUP.ops = []
    _GROUP.depth = getattr(_GROUP, "depth", 0) + 1


def groupEnd() -> None:
    depth = getattr(_GROUP, "depth", 0)
    if not depth:
        raise NcclError("NCCL_ERROR_INVALID_USAGE: groupEnd without groupStart")
    _GROUP.depth = depth - 1
    if depth == 1:
        ops, _GROUP.ops = _GROUP.ops, []
        _issue(ops)


def _issue(ops: list[tuple[_Op, int]]) -> None:
    with _LOCK:
        groups: dict[int, list[_Op]] = {}
        for op, stream_ptr in ops:
            if stream_ptr not in _STREAMS:
                raise NcclError(f"NCCL_ERROR_INVALID_ARGUMENT: unknown stream {stream_ptr:#x}")
            groups.setdefault(stream_ptr, []).append(op)
            if op.kind == "send":
                op.comm.world.sends.setdefault((op.comm.rank, op.peer), deque()).append(op)
        for stream_ptr, group in groups.items():
            _STREAMS[stream_ptr].groups.append(group)
        _LOCK.notify_all()


def get_unique_id() -> tuple[int, ...]:
    raw = np.frombuffer(np.random.default_rng().bytes(NCCL_UNIQUE_ID_BYTES), dtype=np.int8)
    return tuple(int(c) for c in raw)


class _Event:
    def __init__(self, block: bool = False, disable_timing: bool = False, interprocess: bool = False) -> None:
        self._ops: list[_Op] = []

    def record(self, stream: _Stream | None = None) -> None:
        self._ops = [op for g in stream.groups for op in g] if stream is not None else []

    @property
    def done(self) -> bool:
        with _LOCK:
            for world in {id(op.comm.world): op.comm.world for op in self._ops}.values():
                _progress(world)
            return all(op.done for op in self._ops)


class _Device:
    def __init__(self, device: int = 0) -> None:
        self.id = device
        self.pci_bus_id = f"0000:{device:02x}:00.0"

    def __enter__(self) -> _Device:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def modules(cuda_major: int = 12) -> tuple[Any, Any]:
    """``(cupy, cupy.cuda.nccl)`` look-alikes (``cuda_major``: the CUDA runtime cupy was built for)."""
    nccl = SimpleNamespace(available=True, NCCL_UINT8=NCCL_UINT8, NcclCommunicator=FakeComm, NcclError=NcclError,
                           groupStart=groupStart, groupEnd=groupEnd, get_unique_id=get_unique_id)
    runtime = SimpleNamespace(runtimeGetVersion=lambda: cuda_major * 1000 + 40)
    cuda = SimpleNamespace(is_available=lambda: True, Device=_Device, Event=_Event, Stream=_Stream,
                           runtime=runtime, nccl=nccl)
    return SimpleNamespace(cuda=cuda), nccl


def install(monkeypatch: Any, *, one_gpu_per_rank: bool = False) -> None:
    """Make `kv_transfer.nccl` use these look-alikes on CPU tensors (``monkeypatch``: pytest's).

    ``one_gpu_per_rank``: the source and the destination report different GPUs, as two replicas
    on two GPUs do (by default both ends report the same one, which NCCL refuses)."""
    import torch

    import kv_transfer.nccl as nccl_mod

    monkeypatch.setattr(nccl_mod, "_cupy", modules)
    monkeypatch.setattr(nccl_mod, "_current_device", lambda: torch.device("cpu"))
    if one_gpu_per_rank:
        init = nccl_mod.NcclTransport.__init__

        def per_rank(self: Any, rank: int, *, host: str, timeout_s: float) -> None:
            init(self, rank, host=host, timeout_s=timeout_s)
            self.device = f"{self.device}/rank-{rank}"

        monkeypatch.setattr(nccl_mod.NcclTransport, "__init__", per_rank)
