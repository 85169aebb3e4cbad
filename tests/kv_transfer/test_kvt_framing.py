"""Frames: partial frames, silent peers and huge declared lengths (refused before any allocation)."""

from __future__ import annotations

import asyncio
import struct

import pytest

from kv_transfer.errors import CodecError, ConnectionClosed, TransferTimeout
from kv_transfer.framing import read_frame, recv_message, send_message, write_frame
from kv_transfer.messages import Ack

pytestmark = pytest.mark.timeout(20)


def reader_with(data: bytes, eof: bool = True) -> asyncio.StreamReader:
    r = asyncio.StreamReader(limit=1 << 16)
    r.feed_data(data)
    if eof:
        r.feed_eof()
    return r


async def test_round_trip_over_a_socket() -> None:
    got: list[object] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        got.append(await recv_message(reader, timeout_s=5))
        await send_message(writer, Ack("t2"), timeout_s=5)
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    await send_message(writer, Ack("t1"), timeout_s=5)
    assert await recv_message(reader, timeout_s=5) == Ack("t2")
    assert got == [Ack("t1")]
    with pytest.raises(ConnectionClosed, match="closed the connection"):
        await recv_message(reader, timeout_s=5)
    writer.close()
    server.close()
    await server.wait_closed()


async def test_huge_declared_length_is_refused_before_reading() -> None:
    r = reader_with(struct.pack(">I", 0xFFFFFFFF), eof=False)  # no body follows, and no EOF
    with pytest.raises(CodecError, match="declares 4294967295 bytes"):
        await read_frame(r, timeout_s=5)  # returns at once: it never waits for the 4 GiB


async def test_zero_length_is_refused() -> None:
    with pytest.raises(CodecError):
        await read_frame(reader_with(struct.pack(">I", 0)), timeout_s=5)


async def test_custom_limit() -> None:
    with pytest.raises(CodecError):
        await read_frame(reader_with(struct.pack(">I", 11) + b"x" * 11), timeout_s=5, max_bytes=10)


async def test_partial_header_and_partial_body() -> None:
    with pytest.raises(ConnectionClosed, match="mid-frame"):
        await read_frame(reader_with(b"\x00\x00"), timeout_s=5)
    with pytest.raises(ConnectionClosed, match="3 of 10 bytes"):
        await read_frame(reader_with(struct.pack(">I", 10) + b"abc"), timeout_s=5)


async def test_silent_peer_times_out() -> None:
    r = reader_with(struct.pack(">I", 10) + b"abc", eof=False)
    with pytest.raises(TransferTimeout):
        await read_frame(r, timeout_s=0.2)


async def test_garbage_body_is_codec_error() -> None:
    with pytest.raises(CodecError):
        await recv_message(reader_with(struct.pack(">I", 3) + b"\xc1\xc1\xc1"), timeout_s=5)


async def test_write_refuses_oversize() -> None:
    with pytest.raises(CodecError):
        await write_frame(None, b"x" * 11, timeout_s=1, max_bytes=10)  # type: ignore[arg-type]
