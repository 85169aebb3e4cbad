"""One generation's Deltas relayed to the client as a Response: its SSE events, or the whole object.

Owns: `stream_events` (the ``text/event-stream`` body: ``event: <type>`` and ``data: <json>`` per
event of the `ResponseWriter`, no ``[DONE]``, as OpenAI's) and `whole_response` (the Deltas read to
the end, the final Response). The app starts the generation (`router.reply.Replies.start`: errors
before the first token are the request's status) and hands both the first Delta and the rest.

Invariants: the decode stream is closed whatever happens (end, error, or a client that left: the
body generator is closed, which cancels the Serve stream and frees the blocks); an error after the
first token is one ``error`` event and the stream ends there; the non-streamed path answers such an
error with its status instead.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable

from router.errors import APIError
from router.generation import Delta
from router.openai_format import sse_event
from router.responses.objects import ResponseObject
from router.responses.writer import ResponseWriter

logger = logging.getLogger("pdserve.router")


async def stream_events(first: Delta, deltas: AsyncGenerator[Delta, None], writer: ResponseWriter,
                        to_error: Callable[[BaseException], APIError]) -> AsyncIterator[str]:
    """The response's SSE body; ``to_error``: how a failure reads to the client."""
    try:
        try:
            for ev in writer.start() + writer.add(first):
                yield sse_event(ev)
            async for delta in deltas:
                for ev in writer.add(delta):
                    yield sse_event(ev)
        except Exception as e:
            err = to_error(e)
            logger.warning("stream %s failed after its first token: %s", writer.id, err.message)
            yield sse_event(writer.error(err.code, err.message, err.param))
    finally:
        await deltas.aclose()


async def whole_response(first: Delta, deltas: AsyncGenerator[Delta, None], writer: ResponseWriter,
                         to_error: Callable[[BaseException], APIError]) -> ResponseObject:
    """The final Response; a failure is raised as ``to_error`` reads it."""
    try:
        writer.add(first)
        async for delta in deltas:
            writer.add(delta)
    except Exception as e:
        raise to_error(e) from None
    finally:
        await deltas.aclose()
    return writer.response()
