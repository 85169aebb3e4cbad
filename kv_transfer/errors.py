"""Exceptions of the KV hand-off; every message names the transfer, the peer or the field at fault.

Hierarchy (catch `TransferError` to catch them all):

- `TransferRefused`: the source (or a local pre-check) will not serve this pull: unknown or expired
  transfer id, mismatched layout, wrong transport. Nothing was sent; the connection stays usable.
- `TransferTimeout`: a peer went silent past a deadline. The pair involved was torn down.
- `CodecError`: bytes that are not a valid handle/message/frame. Also a `ValueError`.
- `AuthError`: the HELLO exchange failed (wrong cluster secret, stale clock, bad MAC).
- `TransportUnavailable`: a transport was asked for that this process cannot run (no CUDA/NCCL,
  unknown name, a same-GPU NCCL pair).
- `ConnectionClosed`: the peer closed the control connection.
"""

from __future__ import annotations


class TransferError(Exception):
    """Base class for every error the KV hand-off raises on purpose."""


class TransferRefused(TransferError):
    """The pull was refused before any data moved; ``reason`` says why, ``fields`` what mismatched."""

    def __init__(self, reason: str, fields: tuple[str, ...] = ()) -> None:
        super().__init__(reason)
        self.reason = reason
        self.fields = fields

    def __reduce__(self) -> tuple[type[TransferRefused], tuple[str, tuple[str, ...]]]:
        return (type(self), (self.reason, self.fields))


class TransferTimeout(TransferError, TimeoutError):
    """A peer did not answer, connect, send or receive within its deadline."""


class CodecError(TransferError, ValueError):
    """Bytes that do not decode to a valid handle, message or frame."""


class AuthError(TransferError):
    """The control-channel handshake failed: the peers do not share the cluster secret, or it was replayed."""


class TransportUnavailable(TransferError):
    """The requested transport cannot run in this process (missing library/device, unknown name)."""


class ConnectionClosed(TransferError):
    """The peer closed the control connection (cleanly at a frame boundary, or mid-frame)."""
