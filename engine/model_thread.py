"""`ModelThread`: the one thread that runs a process's model forwards, off the event loop.

Owns: a single-worker executor per `Engine`. Every forward of a replica (its warm-up included), and
the sampling that reads its logits, runs on this thread, so an async worker can await a step while
its event loop keeps serving and never waits on the device itself.

Why one thread and not `asyncio.to_thread`: the default executor hands each call to whichever of its
threads is free, and glibc gives each thread its own malloc arena. A forward's temporaries then land
in up to ``cpus + 4`` arenas, each growing to the largest forward it happened to run, so a replica's
memory kept creeping for minutes under a mix of prompt lengths (the soak caught it) and a warm-up
on the main thread warmed an arena the forwards never used. One thread means one arena: the warm-up
grows it to its plateau, and load afterwards reuses it.

Invariants: calls run one at a time, in submission order; a cancelled awaiter does not cancel a
forward already running (the caller must not free what the forward reads until `run` returns).
The thread lives as long as its engine (one per replica process); it exits with the interpreter.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


class ModelThread:
    def __init__(self, name: str = "pdserve-model") -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` on the model thread and await its result."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, functools.partial(fn, *args))

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run ``fn(*args)`` on the model thread and block until it returns (for start-up work)."""
        return self._executor.submit(fn, *args).result()
