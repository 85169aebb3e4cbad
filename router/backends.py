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
  (the caller moves the request's choices elsewhere, `router.migration`) after cancelling it; a
  stream prefilled on the decode replica (no KV handle) has the prefill timeout more for its first
  event, since a long prompt's prefill there is not a silence;
- leaving a `generate` context early — stop string, client disconnect, error — cancels the
  decode stream, so the decode replica frees the request's blocks;
- a handle no decode replica took (the request ended between token 0 and the decode call) is
  released through any decode replica (`release`, in the background), not left to its lease.
  Not covered: a prefill that finished just as its caller was cancelled (Serve drops the
  answer); its lease frees it;
- each prefill and decode call is a Serve request of its own (`own_call`): the same request id, so
  logs follow the request, and a fresh internal id. Serve gives a call the internal id of the request
  it is made in, and both Serve's request router (the calls it is routing) and ours
  (`router.replica_router`'s token book) key calls by it: two calls of one request at once (the
  continuations of a request's choices, `router.migration`, routed together) would collide, and
  Serve never assigns the second (its routing task retries for ever, starving the other calls).
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import logging
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from ray.exceptions import RayActorError
from ray.serve import context as serve_context
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

T = TypeVar("T")


def own_call(call: Callable[[], T]) -> T:
    """``call()`` (a handle's ``.remote``, which reads Serve's request context when it is made) as a
    Serve request of its own: the current request id, a fresh internal id (see the module docstring).
    The caller's context is left as it was; outside a Serve request Serve makes fresh ids anyway."""
    return contextvars.copy_context().run(_with_fresh_internal_id, call)


def _with_fresh_internal_id(call: Callable[[], T]) -> T:
    current = serve_context._serve_request_context.get()
    if current is not None:
        serve_context._serve_request_context.set(
            dataclasses.replace(current, _internal_request_id=str(uuid.uuid4())))
    return call()


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
        pool = self._prefill
        assert pool is not None, "prefill() in colocated mode"
        for attempt in (1, 2):
            response = own_call(lambda: pool.prefill.remote(req))
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
        stream = own_call(lambda: self._decode.options(stream=True).generate.remote(req))
        finished = False
        going = {c.index for c in req.choices}

        async def events() -> AsyncIterator[TokenEvent]:
            nonlocal finished
            prefilling = req.handle is None  # prefilled on the decode replica: until its first event
            while True:
                wait_s = self._token_timeout_s + (self._prefill_timeout_s if prefilling else 0.0)
                try:
                    event: TokenEvent = await asyncio.wait_for(stream.__anext__(), wait_s)
                except StopAsyncIteration:
                    finished = True
                    return
                except asyncio.TimeoutError:
                    what = "the first token (its prefill included)" if prefilling else "token"
                    raise DecodeLost(TOKEN_TIMEOUT,
                                     f"no {what} from the decode pool within {wait_s:g} s") from None
                except REPLICA_GONE as e:
                    raise DecodeLost(REPLICA_DIED, "the decode replica serving this request went away") from e
                prefilling = False
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
        # one task per pool, waited with asyncio.wait (not gather, whose future would hold the
        # CancelledError of a probe cancelled with its caller, unretrieved); every task is cancelled or
        # read before this returns
        probes = [asyncio.ensure_future(_answer(h)) for h in handles]
        try:
            done, pending = await asyncio.wait(probes, timeout=self._ready_timeout_s)
        finally:
            for t in probes:
                t.cancel()
        answers = [t.exception() or t.result() for t in done]
        for a in answers:
            if isinstance(a, BaseException) and not isinstance(
                    a, (APIError, RayActorError, DeploymentUnavailableError)):
                logger.error("ready() failed: %r", a)
        return not pending and all(a is True for a in answers)


async def _answer(handle: Any) -> bool:
    """One pool's ``ready()`` answer, as a bool."""
    return bool(await handle.ready.remote())
