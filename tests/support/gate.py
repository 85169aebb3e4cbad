"""`Gate`: a fake that holds one call of a function until the event loop has answered.

For tests that show a worker's event loop stays responsive while a step waits (on the device, in
a real replica): the gate wraps the function a step calls (its forward, its sampler), holds the
chosen call on whatever thread makes it, and `Gate.answer`, a coroutine on the loop, opens it once
the call is held. The order of what happened says where the call ran: held off the loop, the loop
answers first (``held``, ``answered``, ``released``); held on the loop, the loop cannot answer until
the hold times out (``held``, ``released``, ``answered``). Tests assert the order, never a time.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any


class Gate:
    def __init__(self, fn: Callable[..., Any], hold_call: int = 0, hold_s: float = 10.0) -> None:
        """Wraps ``fn``; call number ``hold_call`` (from 0) is held. Construct it on the event loop."""
        self.fn = fn
        self.hold_call = hold_call
        self.hold_s = hold_s
        self.order: list[str] = []
        self.calls = 0
        self.off_loop: bool | None = None  # whether the held call ran on another thread than the loop's
        self._loop_thread = threading.get_ident()
        self._held = threading.Event()
        self._open = threading.Event()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        n, self.calls = self.calls, self.calls + 1
        if n == self.hold_call:
            self.off_loop = threading.get_ident() != self._loop_thread
            self.order.append("held")
            self._held.set()
            self._open.wait(self.hold_s)  # on the loop's own thread nothing can open it: it times out
            self.order.append("released")
        return self.fn(*args, **kwargs)

    async def answer(self) -> None:
        """On the loop: wait (yielding) until the call is held, note that the loop answered, open it."""
        while not self._held.is_set():
            await asyncio.sleep(0.005)
        self.order.append("answered")
        self._open.set()
