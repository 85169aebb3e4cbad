"""The worker-thread bodies of the data plane: open a pair when replicas meet, move one transfer's bytes.

Each runs in a `blocking.run_bounded` thread and finishes within ``timeout_s`` (every transport
call carries the remaining time). Opening is its own body, run when the pair is set up (PAIR),
never as part of a transfer. A stream's ring slots are taken from the replica's `StagingPool`
here, in the worker thread (waiting for staging memory never blocks the event loop), and go back
when the body ends: for reuse after a completed transfer, dropped after a failure.
"""

from __future__ import annotations

import time

import torch

from kv_transfer.streams import GatherStream, ScatterStream
from kv_transfer.transport import KVTransport, TransportInfo


def open_pair(transport: KVTransport, offer: TransportInfo, timeout_s: float) -> None:
    transport.open(offer, timeout_s)


def send_all(transport: KVTransport, tensors: list[torch.Tensor], timeout_s: float) -> None:
    transport.send(tensors, timeout_s)


def recv_all(transport: KVTransport, into: list[torch.Tensor], timeout_s: float) -> None:
    transport.recv(into, timeout_s)


def send_streamed(transport: KVTransport, stream: GatherStream, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    ok = False
    try:
        stream.reserve(timeout_s)
        transport.send_stream(stream, _left(deadline))
        ok = True
    finally:
        stream.finish(ok)


def recv_streamed(transport: KVTransport, stream: ScatterStream, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    ok = False
    try:
        stream.reserve(timeout_s)
        transport.recv_stream(stream, _left(deadline))
        ok = True
    finally:
        stream.finish(ok)


def _left(deadline: float) -> float:
    return max(deadline - time.monotonic(), 0.001)
