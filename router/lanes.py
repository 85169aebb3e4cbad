"""One request's decode streams read as one: `Lanes`, each stream a `Lane`.

A request starts with one decode call (every choice in it). When that call's replica goes away, each
choice still going moves to a continuation of its own (`router.migration`), so a request may have
several decode calls at once; the router reads their events in arrival order, as one stream.

Owns: `Lane` (one decode call: its request, its KV handle until a decode replica answers for it,
how to build its KV again, whether it has decoded) and `Lanes` (a task per live lane pumping its
events into one queue; `next` returns them with their lane, a lane's failure as an exception, and
its end as None).

Invariants: a lane that was stopped yields nothing more, even what its task had already queued (a
replica that hung and wakes never reaches the client); stopping a lane cancels its task, and with
it the decode stream (`router.backends.Backends.generate` cancels on exit); a handle that no decode
replica answered for is released when its lane is stopped or `close`d, never left to its lease.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from decode_worker.types import DecodeRequest, TokenEvent
from kv_transfer.handle import KVHandle
from prefill_worker.types import PrefillRequest
from router.backends import Backends

#: what `Lanes.next` returns for a lane: an event, the exception that ended its stream, or None (it ended)
LaneItem = TokenEvent | Exception | None


@dataclass(eq=False)
class Lane:
    req: DecodeRequest
    rebuild: PrefillRequest | None = None  # builds its KV again if the pull fails before any token
    claimed: bool = False  # a decode replica answered for its handle: it pulls or releases it
    decoded: bool = False  # an event of it brought a token

    @property
    def handle(self) -> KVHandle | None:
        return self.req.handle

    @property
    def indices(self) -> tuple[int, ...]:
        return tuple(c.index for c in self.req.choices)


class Lanes:
    """The live lanes of one request (see the module docstring). Used from one task (the request's)."""

    def __init__(self, backends: Backends) -> None:
        self._backends = backends
        self._queue: asyncio.Queue[tuple[Lane, LaneItem]] = asyncio.Queue()
        self._tasks: dict[Lane, asyncio.Task[None]] = {}

    def __bool__(self) -> bool:
        return bool(self._tasks)

    def start(self, lane: Lane) -> None:
        self._tasks[lane] = asyncio.create_task(self._pump(lane))

    async def _pump(self, lane: Lane) -> None:
        try:
            async with self._backends.generate(lane.req) as events:
                async for ev in events:
                    self._queue.put_nowait((lane, ev))
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self._queue.put_nowait((lane, e))
            return
        self._queue.put_nowait((lane, None))

    async def next(self) -> tuple[Lane, LaneItem]:
        """The next item of a live lane (some lane must be live); a lane's None or exception ends it."""
        while True:
            lane, item = await self._queue.get()
            if lane not in self._tasks:
                continue  # stopped: whatever it still sent is dropped
            if item is None or isinstance(item, Exception):
                self._tasks.pop(lane)
            return lane, item

    def stop(self, lane: Lane) -> None:
        """Stop reading ``lane``: its stream is cancelled, its handle released if no replica answered."""
        task = self._tasks.pop(lane, None)
        if task is not None:
            task.cancel()
        self.abandon(lane)

    def abandon(self, lane: Lane) -> None:
        """``lane`` is over (ended, failed or stopped): release its handle if no replica answered for it."""
        if lane.handle is not None and not lane.claimed:
            lane.claimed = True  # released once
            self._backends.release(lane.handle)

    def close(self) -> None:
        """Stop every live lane (the request ended or its consumer left); never waits."""
        for lane in list(self._tasks):
            self.stop(lane)
