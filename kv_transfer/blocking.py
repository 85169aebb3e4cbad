"""Running blocking data-plane work off the event loop, with a deadline, in a dedicated executor.

Two kinds of work, two helpers:

- `run_bounded`: network waits (open, send, recv). Abandoned on timeout or cancellation: the thread
  runs on until its own deadline (every transport call carries one) while the caller tears the pair
  down. Such work must only touch memory the caller can afford to drop (a staging buffer, a copy).
- `run_to_completion`: work that reads or writes cache blocks (gather, scatter). Never abandoned:
  if the caller is cancelled, it still waits for the thread to finish before the cancellation
  propagates, so no block is touched after its owner got it back.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from kv_transfer.errors import TransferError, TransferTimeout

T = TypeVar("T")


def make_executor(name: str, max_workers: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=name)


async def run_bounded(executor: ThreadPoolExecutor, timeout_s: float, what: str,
                      fn: Callable[..., T], *args: Any) -> T:
    loop = asyncio.get_running_loop()
    fut = loop.run_in_executor(executor, functools.partial(fn, *args))
    try:
        return await asyncio.wait_for(fut, max(timeout_s, 0.001))
    except TransferError:  # the work's own error (TransferTimeout is a TimeoutError too): as it is
        raise
    except asyncio.TimeoutError:
        raise TransferTimeout(f"{what} did not finish within {timeout_s:.1f}s") from None


async def run_to_completion(executor: ThreadPoolExecutor, fn: Callable[..., T], *args: Any) -> T:
    loop = asyncio.get_running_loop()
    fut = loop.run_in_executor(executor, functools.partial(fn, *args))
    try:
        return await asyncio.shield(fut)
    except asyncio.CancelledError:
        while not fut.done():
            try:
                await asyncio.wait([fut])
            except asyncio.CancelledError:
                continue  # cancelled again: still wait, the blocks are in use
        raise
