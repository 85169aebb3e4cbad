"""`KVHandle`: the claim ticket for a finished prefill's KV blocks, and its msgpack codec.

Owns: the small value the prefill replica returns (through the router, through Ray) to the decode
replica: which transfer, where its source listens, how many tokens, what layout, until when.

Invariants: a `KVHandle` is frozen and valid by construction (checked in ``__post_init__``, so a
handle built by hand is as trustworthy as a decoded one); `decode_handle` accepts at most
`MAX_HANDLE_BYTES` of input, a known version, exactly the known fields with the right types and
ranges, and raises `CodecError` for anything else; pickling goes through the same codec, so a
handle that crossed Ray was validated on arrival. ``expires_at`` is unix time (``time.time()``): it
crosses hosts, so it is informative to the puller; only the source's own clock decides expiry.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

from kv_transfer.errors import CodecError
from kv_transfer.layout import KVLayout
from kv_transfer.wire import HOST_RE, ID_RE, Fields, pack, unpack_map

HANDLE_VERSION = 1
MAX_HANDLE_BYTES = 4096
#: Longest prompt a handle may claim; far above any context we serve, low enough to bound allocations.
MAX_TOKENS = 1 << 24
_MAX_UNIX_TIME = 1e11


@dataclass(frozen=True)
class KVHandle:
    """Where and what to pull: ``transfer_id`` at ``source_host:source_port``, ``n_tokens`` of ``layout``."""

    transfer_id: str
    source_host: str
    source_port: int
    n_tokens: int
    layout: KVLayout
    expires_at: float  # unix seconds, by the source's clock

    def __post_init__(self) -> None:
        if type(self.transfer_id) is not str or not ID_RE.fullmatch(self.transfer_id):
            raise ValueError(f"KVHandle.transfer_id must match {ID_RE.pattern}, got {self.transfer_id!r}")
        if type(self.source_host) is not str or not HOST_RE.fullmatch(self.source_host):
            raise ValueError(f"KVHandle.source_host must match {HOST_RE.pattern}, got {self.source_host!r}")
        if type(self.source_port) is not int or not 0 < self.source_port < 65536:
            raise ValueError(f"KVHandle.source_port must be in 1..65535, got {self.source_port!r}")
        if type(self.n_tokens) is not int or not 1 <= self.n_tokens <= MAX_TOKENS:
            raise ValueError(f"KVHandle.n_tokens must be in 1..{MAX_TOKENS}, got {self.n_tokens!r}")
        if not isinstance(self.layout, KVLayout):
            raise ValueError(f"KVHandle.layout must be a KVLayout, got {type(self.layout).__name__}")
        e = self.expires_at
        if type(e) not in (int, float) or not math.isfinite(e) or not 0 <= e <= _MAX_UNIX_TIME:
            raise ValueError(f"KVHandle.expires_at must be unix seconds, got {e!r}")

    @property
    def source(self) -> tuple[str, int]:
        return (self.source_host, self.source_port)

    @property
    def n_blocks(self) -> int:
        return self.layout.blocks_for_tokens(self.n_tokens)

    @property
    def nbytes(self) -> int:
        return self.layout.nbytes_for_tokens(self.n_tokens)

    def seconds_left(self, now: float | None = None) -> float:
        """Lease time left by this host's clock (hosts' clocks may differ; the source decides)."""
        return self.expires_at - (time.time() if now is None else now)

    def __reduce__(self) -> tuple[Any, tuple[bytes]]:
        # Ray and multiprocessing pickle handles: send the validated wire form, not the object graph.
        return (decode_handle, (encode_handle(self),))


def encode_handle(h: KVHandle) -> bytes:
    """The wire form of ``h``: a versioned msgpack map, at most `MAX_HANDLE_BYTES`."""
    out = pack({
        "v": HANDLE_VERSION,
        "transfer_id": h.transfer_id,
        "source_host": h.source_host,
        "source_port": h.source_port,
        "n_tokens": h.n_tokens,
        "layout": h.layout.to_wire(),
        "expires_at": float(h.expires_at),
    })
    assert len(out) <= MAX_HANDLE_BYTES  # every field is bounded, so this cannot fire
    return out


def decode_handle(data: bytes) -> KVHandle:
    """Parse and validate a handle; any defect raises `CodecError` with the reason."""
    f = unpack_map(data, max_bytes=MAX_HANDLE_BYTES, what="KVHandle")
    version = f.get_int("v", lo=0, hi=1 << 31)
    if version != HANDLE_VERSION:
        raise CodecError(f"KVHandle: unsupported version {version} (this build speaks {HANDLE_VERSION})")
    return _handle_from_fields(f)


def _handle_from_fields(f: Fields) -> KVHandle:
    try:
        h = KVHandle(
            transfer_id=f.get_str("transfer_id", pattern=ID_RE, max_len=128),
            source_host=f.get_str("source_host", pattern=HOST_RE, max_len=255),
            source_port=f.get_int("source_port", lo=1, hi=65535),
            n_tokens=f.get_int("n_tokens", lo=1, hi=MAX_TOKENS),
            layout=KVLayout.from_wire(f.get_map("layout")),
            expires_at=f.get_float("expires_at", lo=0.0, hi=_MAX_UNIX_TIME),
        )
    except ValueError as e:  # the dataclass's own checks (CodecError is a ValueError too)
        if isinstance(e, CodecError):
            raise
        raise CodecError(f"KVHandle: {e}") from None
    f.finish()
    return h
