"""Length-prefixed frames on an asyncio stream: 4-byte big-endian length, then a msgpack body.

Owns: reading and writing one frame / one `Message` with a deadline.

Invariants: a declared length of 0 or above ``max_bytes`` is refused (`CodecError`) before a single
body byte is read or allocated; every write has a timeout, every read one too (`TransferTimeout`)
except the wait for the next exchange on an idle connection (``timeout_s=None``: a pair lives
until its peer dies, which TCP keepalive (`keep_alive`) detects on a silent host); a peer that
closes at a frame boundary gives `ConnectionClosed("...closed the connection")`, one that closes
mid-frame `ConnectionClosed("...mid-frame")`. After any error the stream is out of sync: close it.
"""

from __future__ import annotations

import asyncio
import socket
import struct

from kv_transfer.errors import CodecError, ConnectionClosed, TransferError, TransferTimeout
from kv_transfer.messages import MAX_MESSAGE_BYTES, Message, decode_message, encode_message

_HEADER = struct.Struct(">I")


async def read_frame(reader: asyncio.StreamReader, *, timeout_s: float | None,
                     max_bytes: int = MAX_MESSAGE_BYTES) -> bytes:
    """One frame's body; see the module invariants for the errors."""
    try:
        return await asyncio.wait_for(_read_frame(reader, max_bytes), timeout_s)
    except asyncio.TimeoutError:
        raise TransferTimeout(f"no complete frame within {timeout_s or 0:.1f}s") from None


async def _read_frame(reader: asyncio.StreamReader, max_bytes: int) -> bytes:
    try:
        header = await reader.readexactly(_HEADER.size)
    except asyncio.IncompleteReadError as e:
        if e.partial:
            raise ConnectionClosed("peer closed the connection mid-frame (in the length)") from None
        raise ConnectionClosed("peer closed the connection") from None
    (n,) = _HEADER.unpack(header)
    if n == 0 or n > max_bytes:
        raise CodecError(f"frame declares {n} bytes; allowed 1..{max_bytes}")
    try:
        return await reader.readexactly(n)
    except asyncio.IncompleteReadError as e:
        raise ConnectionClosed(f"peer closed the connection mid-frame ({len(e.partial)} of {n} bytes)") \
            from None


async def write_frame(writer: asyncio.StreamWriter, body: bytes, *, timeout_s: float,
                      max_bytes: int = MAX_MESSAGE_BYTES) -> None:
    if not 0 < len(body) <= max_bytes:
        raise CodecError(f"refusing to send a frame of {len(body)} bytes; allowed 1..{max_bytes}")
    try:
        writer.write(_HEADER.pack(len(body)) + body)
        await asyncio.wait_for(writer.drain(), timeout_s)
    except asyncio.TimeoutError:
        raise TransferTimeout(f"peer did not take a {len(body)}-byte frame within {timeout_s:.1f}s") \
            from None
    except OSError as e:
        raise ConnectionClosed(f"connection lost while sending: {e}") from None


async def send_message(writer: asyncio.StreamWriter, msg: Message, *, timeout_s: float) -> None:
    await write_frame(writer, encode_message(msg), timeout_s=timeout_s)


async def recv_message(reader: asyncio.StreamReader, *, timeout_s: float | None,
                       max_bytes: int = MAX_MESSAGE_BYTES) -> Message:
    try:
        return decode_message(await read_frame(reader, timeout_s=timeout_s, max_bytes=max_bytes))
    except TransferError:  # TransferTimeout is an OSError (TimeoutError): keep it as it is
        raise
    except OSError as e:
        raise ConnectionClosed(f"connection lost while receiving: {e}") from None


#: TCP keepalive: idle seconds before the first probe, seconds between probes, probes before "dead".
KEEPALIVE = (30, 10, 3)


def keep_alive(writer: asyncio.StreamWriter) -> None:
    """Turn on TCP keepalive, so a long-lived control connection to a dead host ends (and its pair)."""
    sock = writer.get_extra_info("socket")
    if sock is None:
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for opt, value in zip(("TCP_KEEPIDLE", "TCP_KEEPINTVL", "TCP_KEEPCNT"), KEEPALIVE, strict=True):
        if hasattr(socket, opt):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), value)
