"""`Replies`: a generation request's answer, from its prompt to SSE chunks or one JSON response.

Owns what every generating endpoint (`router.app.Router`: completions, chat completions, responses)
does once its request is validated and its prompt built: the request's objective
(`router.request_objective`), its sampling parameters (`router.prompt.sampling_for`; a forced tool
call's grammar in place of ``response_format``'s, otherwise that one compiled against the tokenizer
first), its `router.generation.Generation` started and its first `Delta` awaited, then the answer:
SSE chunks ending in ``data: [DONE]`` (usage last, when asked), or one JSON response.

Why the first delta is awaited before any status is sent: it is the last point where an error can
still be the HTTP status the client gets (429 with Retry-After, 503, ...).

Invariants: errors before the first token get their real status (`start` raises the `APIError`);
after it, a stream ends with ``data: {"error": …}`` then ``data: [DONE]``, a JSON answer is the
error's own response; the decode stream (``deltas``) is closed whatever happens, so a client that
goes away mid-stream cancels it (the generator is closed, which cancels the Serve stream).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator

from fastapi.responses import JSONResponse, Response, StreamingResponse

from engine.sampling.grammar import GrammarSpec
from router.codec import TextCodec
from router.config import RouterConfig
from router.errors import APIError, from_exception
from router.generation import Delta, Generation, GenerationInput, StreamError
from router.openai_format import DONE, Formatter, sse
from router.prompt import sampling_for
from router.protocol import GenerationRequest
from router.request_objective import objective_for
from router.response_format import check_grammar

logger = logging.getLogger("pdserve.router")

#: the headers of every SSE answer (no caching; no buffering in a proxy such as nginx)
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def stream_error(exc: BaseException) -> APIError:
    if isinstance(exc, StreamError):
        return APIError(500, str(exc), type="server_error", code="stream_error")
    return from_exception(exc)


@dataclasses.dataclass(frozen=True)
class Replies:
    """One router replica's generation requests, started and answered."""

    config: RouterConfig
    codec: TextCodec
    max_model_len: int
    generation: Generation

    async def start(self, prompt: tuple[int, ...], req: GenerationRequest, fmt: Formatter,
                    prompt_logprobs: int | None, grammar: GrammarSpec | None = None
                    ) -> tuple[Delta, AsyncGenerator[Delta, None]]:
        """The request's generation, started: its first Delta and the rest. ``grammar``: a forced tool
        call's (already checked), in place of ``response_format``'s. An error before the first token
        is raised as the `APIError` the client gets (429, 503, ...)."""
        arrival_mono, arrival_time = time.perf_counter(), time.time()
        objective = objective_for(self.config.objectives, len(prompt), req.slo_class, arrival_time)
        sampling = sampling_for(req, len(prompt), self.max_model_len, self.config.default_max_tokens,
                                self.codec.eos_token_ids, fmt.logprobs, self.codec.vocab_size, fmt.top_logprobs,
                                self.codec.sampling_defaults)
        if grammar is not None:
            sampling = dataclasses.replace(sampling, grammar=grammar)
        else:
            await check_grammar(sampling.grammar, self.codec)
        inp = GenerationInput(request_id=fmt.id, prompt_token_ids=prompt, sampling=sampling,
                              stop_strings=req.stop_strings, include_stop_str=req.include_stop_str_in_output,
                              skip_special_tokens=req.skip_special_tokens, prompt_logprobs=prompt_logprobs,
                              arrival_time=arrival_time, arrival_mono=arrival_mono, n=req.n, objective=objective)
        deltas = self.generation.stream(inp)
        try:
            first = await deltas.__anext__()
        except StopAsyncIteration:
            raise stream_error(StreamError("the generation produced no tokens")) from None
        except Exception as e:
            await deltas.aclose()
            raise stream_error(e) from None
        return first, deltas

    async def answer(self, stream: bool, first: Delta, deltas: AsyncGenerator[Delta, None],
                     fmt: Formatter) -> Response:
        """A started completion or chat completion: SSE chunks ending in ``[DONE]``, or one JSON response."""
        if stream:
            return StreamingResponse(self.sse(first, deltas, fmt), media_type="text/event-stream",
                                     headers=SSE_HEADERS)
        try:
            fmt.add(first)
            async for delta in deltas:
                fmt.add(delta)
        except Exception as e:
            return stream_error(e).response()
        finally:
            await deltas.aclose()
        return JSONResponse(fmt.response().model_dump())

    async def sse(self, first: Delta, deltas: AsyncGenerator[Delta, None], fmt: Formatter) -> AsyncIterator[str]:
        try:
            try:
                yield sse(fmt.chunk(first))
                async for delta in deltas:
                    yield sse(fmt.chunk(delta))
                if fmt.include_usage:
                    yield sse(fmt.usage_chunk())
            except Exception as e:
                err = stream_error(e)
                logger.warning("stream %s failed after its first token: %s", fmt.id, err.message)
                yield sse(err.body())
            yield DONE
        finally:
            await deltas.aclose()
