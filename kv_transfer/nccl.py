"""`NcclTransport` (``nccl``): the GPU data plane, one `cupy.cuda.nccl.NcclCommunicator` of two ranks per pair.

Owns: the per-pair communicator and its side stream. When a decode replica meets a prefill replica
(`KVPuller.meet`, PAIR / PAIR_READY on the control channel), the source (rank 0) makes the NCCL
unique id (`offer`), both ends build ``NcclCommunicator(2, uid, rank)`` (`open`), and the pair lives
until its peer dies or a failure aborts it; no transfer ever waits for a communicator's init.

cupy's API, exactly (``cupy_backends/cuda/libs/nccl.pyx``; tests/support/fake_cupy.py mirrors it
and tests/kv_transfer/test_kvt_cupy_api.py holds both to one contract): ``get_unique_id()`` is a
tuple of 128 ints in ``-128..127``; ``NcclCommunicator(ndev, commId, rank)`` takes that tuple (bytes
are a TypeError); ``send``/``recv(ptr, count, datatype, peer, stream_ptr)`` take ints. On the control
channel the id travels as 128 raw bytes (`TransportInfo.token`), converted at each end.

Transfers stream chunk by chunk like gloo's (`streams.py`): the source gathers chunk ``i`` into a
ring slot while the side stream still sends chunk ``i - 1``; the destination keeps up to ``window``
receives posted and scatters each chunk as it lands. So a transfer is ``len(plan_chunks)`` sends,
about one per layer, whatever the fragmentation of either side's blocks, and its staging memory is
the ring, bounded by the replica's `StagingPool`.

Invariants:
- cupy is imported lazily: importing this module never needs a GPU; asking for ``nccl`` where cupy
  (for CUDA 12 or 13), CUDA or NCCL is missing fails at startup with `TransportUnavailable`.
- NCCL refuses two ranks on one GPU, so `offer`/`open` refuse a pair whose ends report the same
  device (``<host id>/<PCI bus id>``: bus ids repeat across hosts, so the host's boot id is part of
  it, which also catches two containers sharing a GPU) with `TransferRefused`; such a pair belongs
  in ``mode: colocated`` (or a CUDA-IPC path).
- Tensors travel as raw bytes (``NCCL_UINT8``), so bf16/fp16/fp32 all arrive bit-exact.
- A slot is refilled only after the send that read it completed; a slot is drained only after its
  receive completed, and re-posted only after the drain (which synchronizes the device).
- No wait is unbounded: completion is polled against the deadline together with
  ``check_async_error``; on timeout or error the communicator is aborted (``ncclCommAbort``), which
  also stops kernels still writing into the destination's buffers.
- The communicator uses the CUDA device current when the transport is made (each replica owns one).
  Communicator *init* blocks inside NCCL's bootstrap (``timeout_s`` cannot interrupt it); `meet`
  runs `open` in a worker thread under the pair's own timeout and tears the pair down if it passes.
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from kv_transfer.errors import TransferError, TransferRefused, TransferTimeout, TransportUnavailable
from kv_transfer.transport import SOURCE_RANK, ChunkSink, ChunkSource, KVTransport, TransportInfo, check_contiguous

_PEER = {0: 1, 1: 0}
_POLL_S = 0.0002
_UID_BYTES = 128
#: CUDA runtimes whose cupy wheels (cupy-cuda12x, cupy-cuda13x) this transport accepts.
CUDA_MAJORS = (12, 13)


def _cupy() -> tuple[Any, Any]:
    import cupy
    from cupy.cuda import nccl

    return cupy, nccl


def _current_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def _host_id() -> str:
    """Identity of the physical host: the kernel boot id (shared by containers), else the hostname."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


class NcclTransport(KVTransport):
    """One end of an NCCL pair on this process's current CUDA device."""

    name = "nccl"

    @classmethod
    def unavailable_reason(cls) -> str | None:
        try:
            cupy, nccl = _cupy()
        except ImportError as e:
            return f"cupy is not installed ({e}); install pdserve[gpu] (CUDA 12) or pdserve[gpu-cu13] (CUDA 13)"
        try:
            if not cupy.cuda.is_available():
                return "cupy sees no CUDA device"
            major = cupy.cuda.runtime.runtimeGetVersion() // 1000
        except Exception as e:
            return f"CUDA is not usable: {e}"
        if major not in CUDA_MAJORS:
            return f"cupy is built for CUDA {major}; the nccl transport supports CUDA {CUDA_MAJORS}"
        if not getattr(nccl, "available", False):
            return "cupy was built without NCCL (cupy.cuda.nccl.available is False)"
        return None

    @classmethod
    def is_available(cls) -> bool:
        return cls.unavailable_reason() is None

    def __init__(self, rank: int, *, host: str, timeout_s: float) -> None:
        super().__init__(rank, host=host, timeout_s=timeout_s)
        why = self.unavailable_reason()
        if why is not None:
            raise TransportUnavailable(f"nccl transport: {why}")
        self._cupy, self._nccl = _cupy()
        self.torch_device = _current_device()
        self.device_index = self.torch_device.index or 0
        bus = self._cupy.cuda.Device(self.device_index).pci_bus_id
        self.device = f"{_host_id()}/{bus}"
        self._comm: Any = None
        self._stream: Any = None
        self._broken = False

    def local_info(self) -> TransportInfo:
        return TransportInfo(name=self.name, device=self.device)

    def _check_not_same_gpu(self, peer_device: str) -> None:
        if peer_device == self.device:
            raise TransferRefused(
                f"nccl: both ends of the pair are on the same GPU ({self.device}); NCCL refuses two "
                "ranks on one GPU. Run prefill and decode on different GPUs, or use mode: colocated."
            )

    def offer(self, peer: TransportInfo) -> TransportInfo:
        if self.rank != SOURCE_RANK:
            raise TransferError("nccl: only the source (rank 0) makes an offer")
        self._check_not_same_gpu(peer.device)
        with self._cupy.cuda.Device(self.device_index):
            uid = self._nccl.get_unique_id()
        if not isinstance(uid, tuple) or len(uid) != _UID_BYTES:
            raise TransferError(f"nccl: get_unique_id returned {type(uid).__name__}, not {_UID_BYTES} chars")
        return TransportInfo(name=self.name, token=uid_to_bytes(uid), device=self.device)

    def open(self, offer: TransportInfo, timeout_s: float) -> None:
        if self._comm is not None:
            raise TransferError("nccl: pair already open")
        if self.rank != SOURCE_RANK:
            self._check_not_same_gpu(offer.device)
        if len(offer.token) != _UID_BYTES:
            raise TransferError(f"nccl: unique id must be {_UID_BYTES} bytes, got {len(offer.token)}")
        try:
            with self._cupy.cuda.Device(self.device_index):
                self._stream = self._cupy.cuda.Stream(non_blocking=True)
                self._comm = self._nccl.NcclCommunicator(2, bytes_to_uid(offer.token), self.rank)
        except Exception as e:
            self.close()
            raise TransferError(f"nccl: communicator init failed: {e}") from None

    def send(self, tensors: Sequence[torch.Tensor], timeout_s: float) -> None:
        self._run("send", tensors, timeout_s)

    def recv(self, into: Sequence[torch.Tensor], timeout_s: float) -> None:
        self._run("recv", into, timeout_s)

    def _run(self, op: str, tensors: Sequence[torch.Tensor], timeout_s: float) -> None:
        """One group of ``op`` over ``tensors``, awaited."""
        check_contiguous(tensors, f"nccl {op}")
        for t in tensors:
            self._check_device(t, op)
        deadline = time.monotonic() + timeout_s
        with self._guard(op, len(tensors)):
            self._nccl.groupStart()
            try:
                for t in tensors:
                    self._post(op, t)
            finally:
                self._nccl.groupEnd()
            self._await(self._record(), deadline, f"{op} of {len(tensors)} tensor(s)", timeout_s)

    def send_stream(self, stream: ChunkSource, timeout_s: float) -> None:
        """Fill chunk i while the side stream sends chunk i-1; a slot is refilled only after its
        previous send completed."""
        deadline = time.monotonic() + timeout_s
        what = f"streaming {stream.count} chunk(s)"
        with self._guard("send", stream.count):
            sent: dict[int, Any] = {}
            for i in range(stream.count):
                if i >= stream.window:
                    self._await(sent.pop(i - stream.window), deadline, what, timeout_s)
                stream.fill(i)
                buf = stream.buffer(i)
                self._check_device(buf, "send")
                self._post("send", buf)
                sent[i] = self._record()
            for ev in sent.values():
                self._await(ev, deadline, what, timeout_s)

    def recv_stream(self, stream: ChunkSink, timeout_s: float) -> None:
        """Keep ``window`` receives posted; drain chunk i while chunks i+1.. arrive."""
        deadline = time.monotonic() + timeout_s
        what = f"receiving a stream of {stream.count} chunk(s)"
        with self._guard("recv", stream.count):
            posted: dict[int, Any] = {}

            def post(i: int) -> None:
                buf = stream.buffer(i)
                self._check_device(buf, "recv")
                self._post("recv", buf)
                posted[i] = self._record()

            for i in range(min(stream.window, stream.count)):
                post(i)
            for i in range(stream.count):
                self._await(posted.pop(i), deadline, what, timeout_s)
                stream.drain(i)  # synchronizes the device: the slot is free once it returns
                if i + stream.window < stream.count:
                    post(i + stream.window)

    # --- the pieces ---------------------------------------------------------------------------

    def _check_device(self, t: torch.Tensor, op: str) -> None:
        if t.device != self.torch_device:
            raise ValueError(f"nccl {op}: tensor on {t.device}, the pair is on {self.torch_device}")

    def _post(self, op: str, t: torch.Tensor) -> None:
        """Enqueue one p2p op on the side stream (a group of one outside `_run`)."""
        assert self._comm is not None
        fn = self._comm.send if op == "send" else self._comm.recv
        fn(t.data_ptr(), t.numel() * t.element_size(), self._nccl.NCCL_UINT8, _PEER[self.rank], self._stream.ptr)

    def _record(self) -> Any:
        ev = self._cupy.cuda.Event(disable_timing=True)
        ev.record(self._stream)
        return ev

    def _await(self, event: Any, deadline: float, what: str, timeout_s: float) -> None:
        comm = self._comm
        assert comm is not None
        while not event.done:
            comm.check_async_error()
            if time.monotonic() > deadline:
                raise TransferTimeout(f"nccl: {what} timed out after {timeout_s:.1f}s")
            time.sleep(_POLL_S)

    @contextlib.contextmanager
    def _guard(self, op: str, n: int) -> Iterator[None]:
        """The pair must be open; any failure inside aborts it (the owner then drops it)."""
        if self._comm is None or self._broken:
            raise TransferError("nccl: pair is not open")
        try:
            with self._cupy.cuda.Device(self.device_index):
                yield
        except Exception as e:
            self._broken = True
            self._abort()
            if isinstance(e, (TransferError, ValueError)):
                raise
            raise TransferError(f"nccl: {op} of {n} tensor(s) failed: {e}") from None

    def _abort(self) -> None:
        comm, self._comm = self._comm, None
        if comm is not None:
            try:
                comm.abort()
            except Exception:
                pass

    def close(self) -> None:
        comm, self._comm = self._comm, None
        if comm is not None:
            try:
                if self._broken:
                    comm.abort()
                else:
                    comm.destroy()
            except Exception:
                pass
        self._broken = True
        self._stream = None

    @property
    def is_open(self) -> bool:
        return self._comm is not None and not self._broken


def uid_to_bytes(uid: tuple[int, ...]) -> bytes:
    """cupy's unique id (128 signed chars) → the 128 raw bytes the control channel carries."""
    return bytes(c & 0xFF for c in uid)


def bytes_to_uid(token: bytes) -> tuple[int, ...]:
    """The inverse of `uid_to_bytes`: what ``NcclCommunicator`` takes."""
    return tuple(b - 256 if b > 127 else b for b in token)
