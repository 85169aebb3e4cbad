"""`NcclTransport` (``nccl``): the GPU data plane, one `cupy.cuda.nccl.NcclCommunicator` of two ranks per pair.

Owns: the per-pair communicator and its side stream. The source (rank 0) makes the NCCL unique id
(`offer`), the control channel carries it in PULL_READY, both ends build
``NcclCommunicator(2, uid, rank)`` (`open`); each transfer is one ``groupStart()``/``groupEnd()``
group of ``send``/``recv`` on a non-blocking side stream, received straight into the destination's
cache blocks (``direct = True``: one tensor per run of consecutive block ids, per layer, K and V).

Invariants:
- cupy is imported lazily: importing this module never needs a GPU; asking for ``nccl`` where cupy,
  CUDA or NCCL is missing fails at startup with `TransportUnavailable` (see `is_available`).
- NCCL refuses two ranks on one GPU, so `offer`/`open` refuse a pair whose ends report the same
  device (``<host id>/<PCI bus id>``: bus ids repeat across hosts, so the host's boot id is part of
  it, which also catches two containers sharing a GPU) with `TransferRefused`; such a pair belongs
  in ``mode: colocated`` (or a CUDA-IPC path).
- Tensors travel as raw bytes (``NCCL_UINT8``), so bf16/fp16/fp32 all arrive bit-exact.
- The caller's tensors must be complete on their device before `send` (the source synchronizes the
  stream that gathered them); after `recv` returns, the data is complete on the device.
- No wait is unbounded: completion is polled against the deadline together with
  ``check_async_error``; on timeout or error the communicator is aborted (``ncclCommAbort``), which
  also stops kernels still writing into the destination's blocks.
- The communicator uses the CUDA device current when the transport is made (each replica owns one).
  Communicator *init* blocks inside NCCL's bootstrap (``timeout_s`` cannot interrupt it); callers
  run `open` in a worker thread under their own deadline and tear the pair down if it passes.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Sequence
from typing import Any

import torch

from kv_transfer.errors import TransferError, TransferRefused, TransferTimeout, TransportUnavailable
from kv_transfer.transport import SOURCE_RANK, KVTransport, TransportInfo, check_contiguous

_PEER = {0: 1, 1: 0}
_POLL_S = 0.0002


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
    direct = True

    @classmethod
    def unavailable_reason(cls) -> str | None:
        try:
            cupy, nccl = _cupy()
        except ImportError as e:
            return f"cupy is not installed ({e}); install pdserve[gpu]"
        try:
            if not cupy.cuda.is_available():
                return "cupy sees no CUDA device"
        except Exception as e:
            return f"CUDA is not usable: {e}"
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
        # cupy < 13 returns a tuple of signed chars, newer ones bytes.
        token = bytes(uid) if isinstance(uid, (bytes, bytearray)) else bytes(c & 0xFF for c in uid)
        return TransportInfo(name=self.name, token=token, device=self.device)

    def open(self, offer: TransportInfo, timeout_s: float) -> None:
        if self._comm is not None:
            raise TransferError("nccl: pair already open")
        if self.rank != SOURCE_RANK:
            self._check_not_same_gpu(offer.device)
        if len(offer.token) != 128:
            raise TransferError(f"nccl: unique id must be 128 bytes, got {len(offer.token)}")
        try:
            with self._cupy.cuda.Device(self.device_index):
                self._stream = self._cupy.cuda.Stream(non_blocking=True)
                try:
                    self._comm = self._nccl.NcclCommunicator(2, offer.token, self.rank)
                except TypeError:  # cupy < 13 wants a tuple of signed chars
                    uid = tuple(b - 256 if b > 127 else b for b in offer.token)
                    self._comm = self._nccl.NcclCommunicator(2, uid, self.rank)
        except Exception as e:
            self.close()
            raise TransferError(f"nccl: communicator init failed: {e}") from None

    def send(self, tensors: Sequence[torch.Tensor], timeout_s: float) -> None:
        self._run("send", tensors, timeout_s)

    def recv(self, into: Sequence[torch.Tensor], timeout_s: float) -> None:
        self._run("recv", into, timeout_s)

    def _run(self, op: str, tensors: Sequence[torch.Tensor], timeout_s: float) -> None:
        check_contiguous(tensors, f"nccl {op}")
        if self._comm is None or self._broken:
            raise TransferError("nccl: pair is not open")
        for t in tensors:
            if t.device != self.torch_device:
                raise ValueError(f"nccl {op}: tensor on {t.device}, the pair is on {self.torch_device}")
        deadline = time.monotonic() + timeout_s
        cupy, nccl, comm, stream = self._cupy, self._nccl, self._comm, self._stream
        peer = _PEER[self.rank]
        try:
            with cupy.cuda.Device(self.device_index):
                nccl.groupStart()
                try:
                    for t in tensors:
                        fn = comm.send if op == "send" else comm.recv
                        fn(t.data_ptr(), t.numel() * t.element_size(), nccl.NCCL_UINT8, peer, stream.ptr)
                finally:
                    nccl.groupEnd()
                done = cupy.cuda.Event(disable_timing=True)
                done.record(stream)
                while not done.done:
                    comm.check_async_error()
                    if time.monotonic() > deadline:
                        raise TransferTimeout(f"nccl: {op} of {len(tensors)} tensor(s) timed out "
                                              f"after {timeout_s:.1f}s")
                    time.sleep(_POLL_S)
        except Exception as e:
            self._broken = True
            self._abort()
            if isinstance(e, TransferError):
                raise
            raise TransferError(f"nccl: {op} failed: {e}") from None

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
