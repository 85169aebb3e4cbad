"""The data-plane interface: one `KVTransport` per (source, destination) pair, and the registry.

Life cycle of a pair (the control channel, `server.py` / `client.py`, carries the two infos). A
pair is set up once, when the two replicas meet (`KVPuller.meet`), never inside a transfer:

    destination (rank 1)                           source (rank 0)
    t = make_transport(name, DEST_RANK, ...)
    PAIR{transport_info = t.local_info()}   ──▶    t = make_transport(name, SOURCE_RANK, ...)
                                                   offer = t.offer(peer_info)   # may refuse the pair
                                            ◀──    PAIR_READY{transport_info = offer}
    t.open(offer, timeout)  (both block, in worker threads, until the pair is connected)  t.open(offer, timeout)
    then per transfer (PULL ... DONE):
    t.recv_stream(sink, timeout)            ◀══    t.send_stream(source, timeout)  chunk by chunk
    or t.recv(into, timeout)                ◀══    t.send(tensors, timeout)   (direct transports)
    ...                                            ...
    t.close()  (the peer died, or a failure ended the pair)      t.close()

Invariants every implementation keeps (checked by the shared contract tests):
- ``send(tensors)`` on rank 0 pairs with ``recv(into)`` on rank 1: same count, and pairwise the same
  shape and dtype; bytes arrive unchanged (no casts); ``into`` tensors are written in place.
- Every blocking call (`open`, `send`, `recv`) returns or raises within its timeout: a silent or dead
  peer gives `TransferTimeout` / `TransferError`, never a hang. After any failure the pair is
  unusable: the owner closes it and builds a new one.
- `offer` and `local_info` never block. `close` is idempotent, never raises, and may run while
  another thread is still inside `send`/`recv` (that call then fails or finishes; memory stays valid).
- Transfers on one pair never overlap: callers serialize them.
"""

from __future__ import annotations

import importlib
import re
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch

from kv_transfer.errors import TransferTimeout, TransportUnavailable
from kv_transfer.wire import HOST_RE, NAME_RE, Fields

SOURCE_RANK = 0
DEST_RANK = 1
_DEVICE_RE = re.compile(r"[A-Za-z0-9._:/\-|]{0,256}")


@dataclass(frozen=True)
class TransportInfo:
    """What one side of a pair tells the other to connect: typed, the same fields for every transport.

    gloo: ``host:port`` of the source's per-pair TCPStore, ``token`` = random pair key (store prefix).
    nccl: ``token`` = the NCCL unique id, ``device`` = ``<host id>/<PCI bus id>`` of the sender's GPU.
    local: ``token`` = key of the in-process channel.
    """

    name: str
    host: str = ""
    port: int = 0
    token: bytes = b""
    device: str = ""

    def to_wire(self) -> dict[str, Any]:
        return {"name": self.name, "host": self.host, "port": self.port, "token": self.token,
                "device": self.device}

    @classmethod
    def from_wire(cls, f: Fields) -> TransportInfo:
        host = f.get_str("host", pattern=HOST_RE, max_len=255, allow_empty=True)
        info = cls(
            name=f.get_str("name", pattern=NAME_RE, max_len=64),
            host=host,
            port=f.get_int("port", lo=0, hi=65535),
            token=f.get_bytes("token", max_len=1024),
            device=f.get_str("device", pattern=_DEVICE_RE, max_len=256, allow_empty=True),
        )
        f.finish()
        return info


class KVTransport(ABC):
    """One end of a data-plane pair; see the module docstring for the life cycle and invariants."""

    #: Registry name, also the ``transport`` field of PULL.
    name: ClassVar[str]
    #: True when `recv` may write straight into the cache's blocks (views of it, one per run of
    #: consecutive block ids); False when it needs one contiguous staging tensor.
    direct: ClassVar[bool] = False

    def __init__(self, rank: int, *, host: str, timeout_s: float) -> None:
        if rank not in (SOURCE_RANK, DEST_RANK):
            raise ValueError(f"rank must be {SOURCE_RANK} (source) or {DEST_RANK} (destination), got {rank}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.rank = rank
        self.host = host  # this side's data-plane address
        self.timeout_s = timeout_s  # ceiling for the pair's own waits (e.g. a rendezvous store's)

    @classmethod
    def is_available(cls) -> bool:
        """Whether this process can run the transport at all (libraries, devices)."""
        return True

    def local_info(self) -> TransportInfo:
        """Destination side: what the source needs to know about this end (sent in PULL)."""
        return TransportInfo(name=self.name)

    @abstractmethod
    def offer(self, peer: TransportInfo) -> TransportInfo:
        """Source side: check the destination's info, reserve a rendezvous, describe it. Never blocks."""

    @abstractmethod
    def open(self, offer: TransportInfo, timeout_s: float) -> None:
        """Both sides, concurrently: connect the pair described by the source's ``offer``."""

    @abstractmethod
    def send(self, tensors: Sequence[torch.Tensor], timeout_s: float) -> None:
        """Source side: send ``tensors`` (contiguous) in order; returns once they are handed over."""

    @abstractmethod
    def recv(self, into: Sequence[torch.Tensor], timeout_s: float) -> None:
        """Destination side: receive into ``into`` (contiguous), pairwise matching the sent tensors."""

    def send_stream(self, stream: ChunkSource, timeout_s: float) -> None:
        """Source side: send ``stream.count`` chunks in order, each filled (``stream.fill(i)``) just in time.

        Default: one `send` per chunk (so the two ends' windows need not agree); transports with
        asynchronous ops override this to overlap the fills with the wire.
        """
        deadline = time.monotonic() + timeout_s
        for i in range(stream.count):
            stream.fill(i)
            self.send([stream.buffer(i)], _left(deadline, timeout_s))

    def recv_stream(self, stream: ChunkSink, timeout_s: float) -> None:
        """Destination side: receive ``stream.count`` chunks, each drained (``stream.drain(i)``) on arrival."""
        deadline = time.monotonic() + timeout_s
        for i in range(stream.count):
            self.recv([stream.buffer(i)], _left(deadline, timeout_s))
            stream.drain(i)

    @abstractmethod
    def close(self) -> None:
        """Tear the pair down; idempotent, never raises."""

    @property
    @abstractmethod
    def is_open(self) -> bool:
        """True between a successful `open` and `close` (or the first failure)."""


class ChunkSource(Protocol):
    """A transfer cut into ``count`` chunks (both ends agree on each one's size) that pass through
    ``window`` reusable buffers; chunk ``i`` lives in ``buffer(i)`` (slot ``i % window``) once
    ``fill(i)`` returned. The window is each end's own: chunks are matched by index."""

    count: int
    window: int

    def buffer(self, i: int) -> torch.Tensor: ...

    def fill(self, i: int) -> None: ...


class ChunkSink(Protocol):
    """The receiving twin of `ChunkSource`: ``drain(i)`` consumes chunk ``i`` from ``buffer(i)``."""

    count: int
    window: int

    def buffer(self, i: int) -> torch.Tensor: ...

    def drain(self, i: int) -> None: ...


def _left(deadline: float, timeout_s: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TransferTimeout(f"stream did not finish within {timeout_s:.1f}s")
    return left


def check_contiguous(tensors: Sequence[torch.Tensor], what: str) -> None:
    for i, t in enumerate(tensors):
        if not t.is_contiguous():
            raise ValueError(f"{what}: tensor {i} of shape {tuple(t.shape)} is not contiguous")


# --- registry -----------------------------------------------------------------------------------

#: name → "module:Class"; imported on first use so that e.g. cupy is only imported for nccl.
_BUILTIN: dict[str, str] = {
    "local": "kv_transfer.local:LocalTransport",
    "local-direct": "kv_transfer.local:LocalDirectTransport",
    "gloo": "kv_transfer.gloo:GlooTransport",
    "nccl": "kv_transfer.nccl:NcclTransport",
}
_REGISTERED: dict[str, type[KVTransport]] = {}


def register_transport(cls: type[KVTransport]) -> type[KVTransport]:
    """Add a transport class under ``cls.name`` (usable as a class decorator)."""
    _REGISTERED[cls.name] = cls
    return cls


def transport_class(name: str) -> type[KVTransport]:
    if name in _REGISTERED:
        return _REGISTERED[name]
    target = _BUILTIN.get(name)
    if target is None:
        known = sorted({*_BUILTIN, *_REGISTERED})
        raise TransportUnavailable(f"unknown KV transport {name!r}; known: {known}")
    module, cls_name = target.split(":")
    cls = getattr(importlib.import_module(module), cls_name)
    assert issubclass(cls, KVTransport)
    return cls


def check_transport_available(name: str) -> type[KVTransport]:
    """The class for ``name``, or `TransportUnavailable` saying why this process cannot run it."""
    cls = transport_class(name)
    if not cls.is_available():
        why = getattr(cls, "unavailable_reason", None)
        detail = f": {why()}" if callable(why) else ""
        raise TransportUnavailable(f"KV transport {name!r} is not available in this process{detail}")
    return cls


def make_transport(name: str, rank: int, *, host: str, timeout_s: float) -> KVTransport:
    """A new, unopened end of a pair; `TransportUnavailable` if this process cannot run ``name``."""
    return check_transport_available(name)(rank, host=host, timeout_s=timeout_s)


def available_transports() -> list[str]:
    """Names of the transports this process can run (``nccl`` only with CUDA + NCCL through cupy)."""
    out = []
    for name in sorted({*_BUILTIN, *_REGISTERED}):
        try:
            if transport_class(name).is_available():
                out.append(name)
        except ImportError:
            continue
    return out
