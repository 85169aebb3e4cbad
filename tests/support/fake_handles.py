"""In-process stand-ins for Serve deployment handles: a replica object called the way the router calls one.

Owns: `FakeHandle` (``handle.options(stream=...).method.remote(*args)`` on a plain object: an awaitable
response, or an async-iterable stream; ``cancel()`` does what Serve does, a CancelledError inside the
replica's coroutine or generator) and the ``calls`` book of method names and cancels, shared by a
handle and the handles its ``options`` return. Lets `router.generation` run without Ray.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any


class _Response:
    def __init__(self, aw: Awaitable[Any]) -> None:
        self._task = asyncio.ensure_future(aw)

    def __await__(self) -> Any:
        return self._task.__await__()

    def cancel(self) -> None:
        self._task.cancel()


class _Stream:
    def __init__(self, agen: Any, calls: list[str]) -> None:
        self._agen, self._calls = agen, calls

    def __aiter__(self) -> _Stream:
        return self

    async def __anext__(self) -> Any:
        return await self._agen.__anext__()

    def cancel(self) -> None:  # what Serve does: CancelledError inside the replica's generator
        self._calls.append("cancel")

        async def _throw() -> None:
            try:
                await self._agen.athrow(asyncio.CancelledError())
            except (asyncio.CancelledError, StopAsyncIteration):
                pass

        self._thrower = asyncio.ensure_future(_throw())


class _Method:
    def __init__(self, fn: Callable[..., Any], stream: bool, calls: list[str]) -> None:
        self._fn, self._stream, self._calls = fn, stream, calls

    def remote(self, *args: Any) -> Any:
        self._calls.append(self._fn.__name__)
        if self._stream:
            return _Stream(self._fn(*args), self._calls)
        return _Response(self._fn(*args))


class FakeHandle:
    def __init__(self, target: Any, stream: bool = False, calls: list[str] | None = None) -> None:
        self._target, self._s, self.calls = target, stream, calls if calls is not None else []

    def options(self, stream: bool = False) -> FakeHandle:
        return FakeHandle(self._target, stream, self.calls)

    def __getattr__(self, name: str) -> _Method:
        return _Method(getattr(self._target, name), self._s, self.calls)
