"""Where a replica's KV transfer endpoint lives: `KVTransferConfig` and `node_address`.

Owns the settings both pools share for moving KV (transport, control-channel address and secret,
lease, timeouts, staging memory), so the prefill and decode packages each depend on kv_transfer,
never on each other. `node_address` is the address other nodes reach this one at.

``max_inflight_bytes`` bounds the staging buffers of all of a replica's transfers in flight (plus
the idle ones kept for reuse), on the cache's device: the source's `StagingPool` on a prefill
replica, the puller's on a decode replica. It is the GPU memory transfers take beside the KV cache,
so a replica's KV budget holds exactly this much back. It must fit one staging chunk
(`kv_transfer.streams.MAX_CHUNK_BYTES`): a smaller value is refused when the replica starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Transport = Literal["gloo", "nccl", "local"]


@dataclass(frozen=True)
class KVTransferConfig:
    """How this replica's KV leaves (prefill) or arrives (decode)."""

    transport: Transport = "gloo"
    host: str | None = None  # address the control channel binds to; None: this node's IP
    port: int = 0  # 0: a free port
    secret: str = ""  # cluster secret for the control channel HMAC
    lease_s: float = 30.0  # outbox lease: blocks not pulled by then are freed
    timeout_s: float = 30.0  # every wait on a peer
    max_inflight_bytes: int = 64 << 20  # staging memory of transfers in flight (see the module doc)

    def __post_init__(self) -> None:
        if self.max_inflight_bytes <= 0:
            raise ValueError(f"kv.max_inflight_bytes must be positive, got {self.max_inflight_bytes}")


def node_address() -> str:
    """This node's address as Ray knows it (what other nodes reach), outside Ray the host's IP."""
    try:
        import ray

        if ray.is_initialized():
            return str(ray.util.get_node_ip_address())
    except Exception:
        pass
    from kv_transfer.node import node_ip

    return node_ip()
