"""The HTTP response that carries a server-sent-event stream, robust to a failing ``receive``.

Owns: `SSEResponse`, Starlette's ``StreamingResponse`` with one change: the task that listens for
the client's disconnect treats an exception from ``receive()`` as "no more news from the client",
not as the end of the response.

Why: on Ray Serve (2.60) the replica's ``receive()`` is a call to the proxy, and that call can be
cancelled while a stream is still being written (``ray.exceptions.TaskCancelledError`` out of
``fetch_until_disconnect``, seen in `tests/reliability/test_http_fuzz.py` on a loaded 2-core host at
the very end of a 55 ms stream). Starlette's listener then raises, its task group cancels the stream,
and the client gets a well-formed body that stops before ``data: [DONE]``: a truncated answer with
no error. With `SSEResponse` the stream runs to its end (its own error event and ``[DONE]``
included); a client that has really gone away still ends it, because the next write fails.

Invariants: a ``http.disconnect`` message still stops the stream at once, as in Starlette; only an
exception raised by ``receive()`` itself is absorbed (logged once per response at INFO).
"""

from __future__ import annotations

import logging

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Receive

logger = logging.getLogger(__name__)


class SSEResponse(StreamingResponse):
    """``StreamingResponse`` whose disconnect listener survives a failing ``receive``."""

    async def listen_for_disconnect(self, receive: Receive) -> None:
        try:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return
        except Exception as e:  # not CancelledError: the end of the stream cancels this listener
            logger.info("receive() failed while streaming (%r); the stream runs to its end", e)
            await anyio.sleep_forever()  # returning would cancel the stream (Starlette's task group)
