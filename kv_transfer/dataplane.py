"""The worker-thread bodies of a transfer: open the pair if it is new, then move the bytes.

Each runs in a `blocking.run_bounded` thread and finishes within ``timeout_s`` (every transport
call carries the remaining time). A stream's ring buffers go back to the pool only after the
transfer completed (see `streams.py`).
"""

from __future__ import annotations

import time

import torch

from kv_transfer.streams import GatherStream, ScatterStream
from kv_transfer.transport import KVTransport, TransportInfo


def _left(deadline: float) -> float:
    return max(deadline - time.monotonic(), 0.001)


def open_and_send(transport: KVTransport, offer: TransportInfo | None, tensors: list[torch.Tensor],
                  timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    if offer is not None:
        transport.open(offer, timeout_s)
    transport.send(tensors, _left(deadline))


def open_and_send_stream(transport: KVTransport, offer: TransportInfo | None, stream: GatherStream,
                         timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    if offer is not None:
        transport.open(offer, timeout_s)
    transport.send_stream(stream, _left(deadline))
    stream.complete()


def open_and_recv(transport: KVTransport, offer: TransportInfo | None, into: list[torch.Tensor],
                  timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    if offer is not None:
        transport.open(offer, timeout_s)
    transport.recv(into, _left(deadline))


def open_and_recv_stream(transport: KVTransport, offer: TransportInfo | None, stream: ScatterStream,
                         timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    if offer is not None:
        transport.open(offer, timeout_s)
    transport.recv_stream(stream, _left(deadline))
    stream.complete()
