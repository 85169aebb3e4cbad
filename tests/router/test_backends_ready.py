"""`router.backends.Backends.ready`: both pools must answer True in time; a failure or a slow pool is
not-ready, never an exception; a probe whose caller gave up leaves nothing unretrieved on the loop."""

from __future__ import annotations

import asyncio
import gc
from typing import Any

from ray.exceptions import RayActorError

from router.backends import Backends
from tests.support.fake_handles import FakeHandle


class Pool:
    def __init__(self, answer: Any = True, delay_s: float = 0.0) -> None:
        self.answer, self.delay_s = answer, delay_s

    async def ready(self) -> bool:
        await asyncio.sleep(self.delay_s)
        if isinstance(self.answer, BaseException):
            raise self.answer
        return bool(self.answer)


def backends(prefill: Pool | None, decode: Pool, ready_timeout_s: float = 1.0) -> Backends:
    return Backends(FakeHandle(prefill) if prefill is not None else None, FakeHandle(decode), 5.0, 5.0,
                    ready_timeout_s)


def test_ready_only_when_every_pool_answers_true() -> None:
    assert asyncio.run(backends(Pool(), Pool()).ready()) is True
    assert asyncio.run(backends(None, Pool()).ready()) is True  # colocated: the decode pool alone
    assert asyncio.run(backends(Pool(False), Pool()).ready()) is False
    assert asyncio.run(backends(Pool(), Pool(RayActorError())).ready()) is False
    assert asyncio.run(backends(Pool(), Pool(RuntimeError("bug"))).ready()) is False
    assert asyncio.run(backends(Pool(delay_s=5.0), Pool(), ready_timeout_s=0.05).ready()) is False


def test_a_probe_cancelled_with_its_caller_leaves_no_unretrieved_exception() -> None:
    seen: list[dict[str, Any]] = []

    async def scenario() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: seen.append(ctx))
        probe = asyncio.ensure_future(backends(Pool(delay_s=5.0), Pool(delay_s=5.0), 10.0).ready())
        await asyncio.sleep(0.05)
        probe.cancel()  # the client gave up: Serve cancels the request
        await asyncio.gather(probe, return_exceptions=True)
        await asyncio.sleep(0.05)
        gc.collect()  # "exception was never retrieved" is reported when the future is collected
        await asyncio.sleep(0)

    asyncio.run(scenario())
    assert not [c for c in seen if "never retrieved" in str(c.get("message", ""))], seen
