"""`StepLoop`: the asyncio task that drives a pool's worker, one step after another.

Owns what the prefill and decode workers' loops share: starting and stopping the task, the wake-up
event (set when work arrives, waited on with a timeout when a step found nothing to do), and the
rule that a step which raises fails the work in hand (``on_error``) but never stops the loop. What a
step does, and what failing the work means, stay in each worker.

Invariants: at most one task runs the steps; ``stop`` returns only once the task has ended, so no
step runs after it. ``idle`` clears the wake-up event and waits: a step calls it right after a plan
that found nothing, with no ``await`` between, so no wake-up is lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)


class StepLoop:
    """Runs ``step`` until stopped; a step that raises is logged and handed to ``on_error``."""

    def __init__(self, name: str, step: Callable[[], Awaitable[None]],
                 on_error: Callable[[Exception], None]) -> None:
        self.name = name  # the task's name, and the log's
        self._step = step
        self._on_error = on_error
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=self.name)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def wake(self) -> None:
        """New work: the next ``idle`` returns at once."""
        self._wake.set()

    async def idle(self, timeout_s: float) -> None:
        """Nothing to do this step: wait for a ``wake`` or ``timeout_s`` (work that comes back
        without a wake, such as blocks freed elsewhere, is seen on the next step)."""
        self._wake.clear()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._wake.wait(), timeout=timeout_s)

    async def _run(self) -> None:
        while True:
            try:
                await self._step()
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a bug in one step must not silently stop the pool
                log.exception("%s error", self.name)
                self._on_error(e)
