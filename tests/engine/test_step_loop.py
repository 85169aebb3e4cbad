"""`engine.step_loop.StepLoop`: steps run until stopped; a failing step fails the work, not the loop."""

from __future__ import annotations

import asyncio

import pytest

from engine.step_loop import StepLoop

pytestmark = pytest.mark.timeout(30)


async def test_a_failing_step_is_handed_over_and_the_loop_goes_on() -> None:
    steps: list[int] = []
    errors: list[str] = []

    async def step() -> None:
        steps.append(len(steps))
        if len(steps) == 2:
            raise RuntimeError("boom")
        await loop.idle(10.0)

    loop = StepLoop("test-step-loop", step, lambda e: errors.append(str(e)))
    await loop.start()
    await loop.start()  # a second start is a no-op: one task runs the steps
    for _ in range(3):
        await asyncio.sleep(0)
        loop.wake()
    while len(steps) < 3:
        await asyncio.sleep(0.01)
    await loop.stop()
    ran = len(steps)
    await asyncio.sleep(0.05)
    assert errors == ["boom"] and len(steps) == ran  # nothing runs after stop
    await loop.stop()  # stopping twice is harmless


async def test_idle_returns_on_wake_or_timeout() -> None:
    loop = StepLoop("idle", lambda: asyncio.sleep(0), lambda e: None)
    waiter = asyncio.create_task(loop.idle(10.0))
    await asyncio.sleep(0)
    loop.wake()
    await asyncio.wait_for(waiter, 5.0)
    await loop.idle(0.01)  # nobody wakes it: the timeout ends the wait
