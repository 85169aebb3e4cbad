"""In-process transports: the same-process fast path and the test double of the real ones.

Owns: `LocalTransport` (``local``: the destination receives into a staging tensor, like gloo) and
`LocalDirectTransport` (``local-direct``: receives straight into the cache's blocks), both
over a `_Channel` kept in a process-wide table under a random token.

Invariants: the same contract as every `KVTransport` (see `transport.py`; the contract tests run this
class and gloo with the same test body): `send` returns only after the receiver copied the data;
every wait has a deadline; a shape/dtype mismatch fails both ends; `close` wakes the other end.
A token names a channel only until both ends have opened it, so the table never grows.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Sequence

import torch

from kv_transfer.errors import TransferError, TransferTimeout
from kv_transfer.transport import SOURCE_RANK, KVTransport, TransportInfo, check_contiguous

_TABLE: dict[bytes, _Channel] = {}
_TABLE_LOCK = threading.Lock()


class _Channel:
    """A one-slot mailbox between the two ends; every field is guarded by ``cv``."""

    def __init__(self) -> None:
        self.cv = threading.Condition()
        self.joined = [False, False]
        self.pending: list[torch.Tensor] | None = None  # what send posted, until recv copied it
        self.copied = False
        self.failed: str | None = None  # set by either end on a mismatch: both ends then fail
        self.closed = False

    def wait_for(self, pred: object, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.closed:
                raise TransferError(f"local transport: pair closed during {what}")
            if self.failed:
                raise TransferError(f"local transport: {self.failed}")
            if callable(pred) and pred():
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransferTimeout(f"local transport: {what} timed out after {timeout_s:.1f}s")
            self.cv.wait(left)


class LocalTransport(KVTransport):
    """Both ends in one process; the destination gets one contiguous tensor per sent tensor."""

    name = "local"

    def __init__(self, rank: int, *, host: str, timeout_s: float) -> None:
        super().__init__(rank, host=host, timeout_s=timeout_s)
        self._chan: _Channel | None = None
        self._token: bytes | None = None
        self._open = False

    def offer(self, peer: TransportInfo) -> TransportInfo:
        token = secrets.token_bytes(16)
        chan = _Channel()
        with _TABLE_LOCK:
            _TABLE[token] = chan
        self._chan, self._token = chan, token
        return TransportInfo(name=self.name, token=token)

    def open(self, offer: TransportInfo, timeout_s: float) -> None:
        with _TABLE_LOCK:
            chan = _TABLE.get(offer.token) if self.rank != SOURCE_RANK else self._chan
        if chan is None:
            raise TransferError("local transport: no such channel (both ends must live in one process)")
        self._chan = chan
        with chan.cv:
            chan.joined[self.rank] = True
            chan.cv.notify_all()
            try:
                chan.wait_for(lambda: all(chan.joined), timeout_s, "open")
            finally:
                with _TABLE_LOCK:
                    if all(chan.joined) or chan.closed:
                        _TABLE.pop(offer.token, None)
        self._open = True

    def _channel(self) -> _Channel:
        if not self._open or self._chan is None:
            raise TransferError("local transport: pair is not open")
        return self._chan

    def send(self, tensors: Sequence[torch.Tensor], timeout_s: float) -> None:
        check_contiguous(tensors, "send")
        chan = self._channel()
        with chan.cv:
            try:
                chan.wait_for(lambda: chan.pending is None, timeout_s, "send")
                chan.pending, chan.copied = list(tensors), False
                chan.cv.notify_all()
                chan.wait_for(lambda: chan.copied, timeout_s, "send")
            except TransferError:
                chan.pending = None
                self._open = False
                raise

    def recv(self, into: Sequence[torch.Tensor], timeout_s: float) -> None:
        check_contiguous(into, "recv")
        chan = self._channel()
        with chan.cv:
            try:
                chan.wait_for(lambda: chan.pending is not None, timeout_s, "recv")
                sent = chan.pending
                assert sent is not None
                problem = _mismatch(sent, into)
                if problem:
                    chan.failed = problem
                    chan.cv.notify_all()
                    raise TransferError(f"local transport: {problem}")
                for src, dst in zip(sent, into, strict=True):
                    dst.copy_(src)  # same dtype and shape: a byte copy
                chan.pending, chan.copied = None, True
                chan.cv.notify_all()
            except TransferError:
                self._open = False
                raise

    def close(self) -> None:
        self._open = False
        chan, self._chan = self._chan, None
        if self._token is not None:
            with _TABLE_LOCK:
                _TABLE.pop(self._token, None)
        if chan is not None:
            with chan.cv:
                chan.closed = True
                chan.cv.notify_all()

    @property
    def is_open(self) -> bool:
        return self._open


class LocalDirectTransport(LocalTransport):
    """`LocalTransport` whose destination receives straight into cache blocks (the nccl shape)."""

    name = "local-direct"
    direct = True


def _mismatch(sent: Sequence[torch.Tensor], into: Sequence[torch.Tensor]) -> str | None:
    if len(sent) != len(into):
        return f"sender has {len(sent)} tensors, receiver {len(into)}"
    for i, (a, b) in enumerate(zip(sent, into, strict=True)):
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"tensor {i}: sent {tuple(a.shape)} {a.dtype}, receiving into {tuple(b.shape)} {b.dtype}"
    return None
