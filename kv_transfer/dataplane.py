"""The worker-thread bodies of a transfer: open the pair if it is new, then move the bytes.

Each runs in a `blocking.run_bounded` thread and finishes within ``timeout_s`` (every transport
call carries the remaining time). A stream's ring buffers go back to the pool only after the
transfer completed (see `streams.py`).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import torch

from kv_transfer.streams import GatherStream, ScatterStream
from kv_transfer.transport import KVTransport, TransportInfo


def open_then(transport: KVTransport, offer: TransportInfo | None, timeout_s: float,
              move: Callable[[float], object]) -> None:
    """Open the pair if ``offer`` is new, then ``move(seconds left)``: both within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    if offer is not None:
        transport.open(offer, timeout_s)
    move(max(deadline - time.monotonic(), 0.001))


def open_and_send(transport: KVTransport, offer: TransportInfo | None, tensors: list[torch.Tensor],
                  timeout_s: float) -> None:
    open_then(transport, offer, timeout_s, functools.partial(transport.send, tensors))


def open_and_send_stream(transport: KVTransport, offer: TransportInfo | None, stream: GatherStream,
                         timeout_s: float) -> None:
    open_then(transport, offer, timeout_s, functools.partial(transport.send_stream, stream))
    stream.complete()


def open_and_recv(transport: KVTransport, offer: TransportInfo | None, into: list[torch.Tensor],
                  timeout_s: float) -> None:
    open_then(transport, offer, timeout_s, functools.partial(transport.recv, into))


def open_and_recv_stream(transport: KVTransport, offer: TransportInfo | None, stream: ScatterStream,
                         timeout_s: float) -> None:
    open_then(transport, offer, timeout_s, functools.partial(transport.recv_stream, stream))
    stream.complete()
