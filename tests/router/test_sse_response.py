"""`router.sse_response.SSEResponse` as a raw ASGI app: a ``receive()`` that raises mid-stream (what
Ray Serve's cancelled proxy call does) no longer cuts the stream short; a real ``http.disconnect``
still stops it; Starlette's own response, for contrast, loses the end of the stream."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from starlette.responses import StreamingResponse

from router.sse_response import SSEResponse

pytestmark = pytest.mark.timeout(30)


async def _events(n: int, gap_s: float) -> AsyncIterator[str]:
    for i in range(n):
        await asyncio.sleep(gap_s)
        yield f"data: {i}\n\n"
    yield "data: [DONE]\n\n"


async def _serve(response: StreamingResponse, receive_fails_after_s: float | None,
                 disconnect_after_s: float | None = None) -> bytes:
    body: list[bytes] = []

    async def receive() -> dict[str, Any]:
        if receive_fails_after_s is not None:
            await asyncio.sleep(receive_fails_after_s)
            raise RuntimeError("Task was cancelled")  # stands in for ray.exceptions.TaskCancelledError
        assert disconnect_after_s is not None
        await asyncio.sleep(disconnect_after_s)
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body":
            body.append(message.get("body", b""))

    scope = {"type": "http", "asgi": {"spec_version": "2.3"}, "method": "GET", "path": "/", "headers": []}
    try:
        await response(scope, receive, send)
    except Exception:  # Starlette's response re-raises the listener's error after cutting the stream
        pass
    return b"".join(body)


def test_a_failing_receive_does_not_cut_the_stream() -> None:
    body = asyncio.run(_serve(SSEResponse(_events(10, 0.01), media_type="text/event-stream"), 0.03))
    assert body.endswith(b"data: 9\n\ndata: [DONE]\n\n"), body


def test_starlettes_response_would_lose_the_end() -> None:
    body = asyncio.run(_serve(StreamingResponse(_events(10, 0.01), media_type="text/event-stream"), 0.03))
    assert b"[DONE]" not in body  # the failure SSEResponse exists for


def test_a_real_disconnect_still_stops_the_stream() -> None:
    body = asyncio.run(_serve(SSEResponse(_events(100, 0.01), media_type="text/event-stream"), None, 0.05))
    assert b"[DONE]" not in body and b"data: 0\n\n" in body
