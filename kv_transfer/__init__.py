"""KV hand-off between prefill and decode replicas: handles, outbox leases, control channel, transports.

Module map (one concept each):

- `layout`: `KVLayout`, the cache fingerprint checked before any byte moves.
- `handle`: `KVHandle` and its msgpack codec (`encode_handle` / `decode_handle`).
- `errors`: `TransferError` and its kinds.
- `wire`, `messages`, `framing`: checked msgpack, the typed control messages, length-prefixed frames.
- `auth`: the HELLO challenge-response (HMAC-SHA256 over the cluster secret).
- `outbox`: the prefill side's blocks under lease.
- `transport` (+ `local`, `gloo`, `nccl`): the data-plane interface, registry and implementations.
- `streams`: the staging-mode wire order (chunks of layers, or slices of a layer, through reusable
  ring slots); `staging`: `StagingPool`, those slots' memory, within ``max_inflight_bytes``;
  `blocks`: the direct-mode order (runs of block ids, in-process only).
- `blocking`: running blocking work off the event loop; `dataplane`: the worker-thread bodies.
- `node`: this node's address and id.
- `server` (`KVSource`, prefill side: listener, offers, lease expiry) and `source_conn` (one
  destination's connection on it); `client` (`KVPuller`, decode side); `peers`: the puller's
  connections and pairs, set up when replicas meet (PAIR), never inside a pull; `keeper`: the
  prefill pool's sources kept met (new ones met, failed ones retried, gone ones forgotten).
- `bench`: ``python -m kv_transfer.bench``: pull throughput between two processes.
"""

from __future__ import annotations

from kv_transfer.client import KVPuller, PullerConfig, PullStats
from kv_transfer.errors import (
    AuthError,
    CodecError,
    ConnectionClosed,
    TransferError,
    TransferRefused,
    TransferTimeout,
    TransportUnavailable,
)
from kv_transfer.handle import KVHandle, decode_handle, encode_handle
from kv_transfer.layout import KVLayout
from kv_transfer.outbox import Outbox, OutboxEntry, OutboxStats
from kv_transfer.server import KVSource, SourceConfig, SourceStats
from kv_transfer.transport import KVTransport, TransportInfo, available_transports, make_transport

__all__ = [
    "AuthError",
    "CodecError",
    "ConnectionClosed",
    "KVHandle",
    "KVLayout",
    "KVPuller",
    "KVSource",
    "KVTransport",
    "Outbox",
    "OutboxEntry",
    "OutboxStats",
    "PullStats",
    "PullerConfig",
    "SourceConfig",
    "SourceStats",
    "TransferError",
    "TransferRefused",
    "TransferTimeout",
    "TransportInfo",
    "TransportUnavailable",
    "available_transports",
    "decode_handle",
    "encode_handle",
    "make_transport",
]
