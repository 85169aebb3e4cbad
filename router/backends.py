"""The router's calls into the prefill and decode pools, with timeouts, one retry and cancellation.

Owns: `Backends`, a thin layer over the two Serve `DeploymentHandle`s (the prefill one is None in
colocated mode). Which replica a call reaches is decided by Serve with our
`router.replica_router.LoadAwareRequestRouter` configured on the target deployment.

Invariants:
- a prefill call that fails before returning because its replica went away (actor died or
  unavailable, deployment unavailable) is retried exactly once, and Serve routes the retry afresh
  (a dead replica is dropped from its set); a second such failure is a 503. Errors the replica
  raised itself (queue full, context too long, bugs) are never retried;
- a call that outlives its timeout is cancelled, then answered with a 503 (prefill); a decode
  stream whose replica went away or sent nothing within the token timeout raises `DecodeLost`
  (the caller moves the request's choices elsewhere, `router.migration`) after cancelling it;
- leaving a `generate` context early — stop string, client disconnect, error — cancels the
  decode stream, so the decode replica frees the request's blocks;
- a handle no decode replica took (the request ended between token 0 and the decode call) is
  released through any decode replica (`release`, in the background), not left to its lease.
  Not covered: a prefill that finished just as its caller was cancelled (Serve drops the
  answer); its lease frees it.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import AsyncIterator, Coroutine
from contextlib import asynccontextmanager
from typing import Any

from ray.exceptions import RayActorError
from ray.serve.exceptions import DeploymentUnavailableError

from decode_worker.types import DecodeRequest, TokenEvent
from kv_transfer.handle import KVHandle
from prefill_worker.types import PrefillRequest, PrefillResult
from router.errors import APIError, unavailable
from router.migration import REPLICA_DIED, TOKEN_TIMEOUT, DecodeLost

logger = logging.getLogger("pdserve.router")

#: failures that mean "the replica went away", not "the replica refused"
REPLICA_GONE: tuple[type[BaseException], ...] = (RayActorError, DeploymentUnavailableError)


#: a background release of an unpulled handle gives up after this (the lease frees it anyway)
RELEASE_TIMEOUT_S = 10.0


class Backends:
    """Handles to the pools plus the policies above (see the module docstring)."""

    def __init__(
        self,
        prefill: Any | None,
        decode: Any,
        prefill_timeout_s: float,
        token_timeout_s: float,
        ready_timeout_s: float,
    ) -> None:
        self._prefill = prefill
        self._decode = decode
        self._prefill_timeout_s = prefill_timeout_s
        self._token_timeout_s = token_timeout_s
        self._ready_timeout_s = ready_timeout_s
        self._background: set[asyncio.Task[None]] = set()

    @property
    def disaggregated(self) -> bool:
        return self._prefill is not None

    async def prefill(self, req: PrefillRequest) -> PrefillResult:
        assert self._prefill is not None, "prefill() in colocated mode"
        for attempt in (1, 2):
            response = self._prefill.prefill.remote(req)
            try:
                result: PrefillResult = await asyncio.wait_for(response, self._prefill_timeout_s)
                return result
            except asyncio.TimeoutError:
                response.cancel()
                raise unavailable(f"prefill did not answer within {self._prefill_timeout_s:g} s") from None
            except asyncio.CancelledError:
                response.cancel()
                raise
            except REPLICA_GONE as e:
                if attempt == 2:
                    raise unavailable("no prefill replica could take the request") from e
                logger.warning("prefill of %s failed (%s); retrying once", req.request_id, type(e).__name__)
        raise AssertionError("unreachable")

    @asynccontextmanager
    async def generate(self, req: DecodeRequest) -> AsyncIterator[AsyncIterator[TokenEvent]]:
        """A decode stream, which ends after every choice's final event; exiting the ``async with``
        before its end cancels it."""
        stream = self._decode.options(stream=True).generate.remote(req)
        finished = False
        going = {c.index for c in req.choices}

        async def events() -> AsyncIterator[TokenEvent]:
            nonlocal finished
            while True:
                try:
                    event: TokenEvent = await asyncio.wait_for(stream.__anext__(), self._token_timeout_s)
                except StopAsyncIteration:
                    finished = True
                    return
                except asyncio.TimeoutError:
                    raise DecodeLost(TOKEN_TIMEOUT,
                                     f"no token from the decode pool within {self._token_timeout_s:g} s") from None
                except REPLICA_GONE as e:
                    raise DecodeLost(REPLICA_DIED, "the decode replica serving this request went away") from e
                if event.finish_reason is not None:
                    going.discard(event.index)
                    finished = not going  # before the yield: a consumer may stop at the last event
                yield event
                if finished:
                    return

        try:
            yield events()
        finally:
            if not finished:
                stream.cancel()

    def release(self, handle: KVHandle) -> None:
        """In the background, ask a decode replica to free ``handle`` at its source (best effort:
        the handle's lease frees it anyway). For a request that ended before the decode pool took it."""

        async def run() -> None:
            try:
                await asyncio.wait_for(self._decode.release.remote(handle), RELEASE_TIMEOUT_S)
            except Exception as e:
                logger.info("release of %s failed (its lease will free it): %r", handle.transfer_id, e)

        self._spawn(run())

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        """Run ``work`` in the background, outside the request's context: Serve cancels every call
        a request made once the request is cancelled (client gone), which is exactly when a
        release must still go out."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no running loop (a generator finalized at shutdown): the lease frees it
            work.close()
            return
        task = contextvars.Context().run(loop.create_task, work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def ready(self) -> bool:
        """Both pools answer ``ready()`` with True within the ready timeout."""
        handles = [h for h in (self._prefill, self._decode) if h is not None]
        try:
            answers = await asyncio.wait_for(
                asyncio.gather(*(h.ready.remote() for h in handles)), self._ready_timeout_s)
        except (asyncio.TimeoutError, APIError, RayActorError, DeploymentUnavailableError):
            return False
        except Exception:
            logger.exception("ready() failed")
            return False
        return all(bool(a) for a in answers)
