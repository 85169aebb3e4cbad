"""OpenAI-shaped errors: one exception type, its HTTP status, and the FastAPI handlers.

Owns: `APIError` (status + ``{"error": {"message", "type", "param", "code"}}``), constructors for
each status we answer with, `from_exception` (engine / Ray / Serve failures → `APIError`) and
`install_handlers`, which makes FastAPI's own validation errors, unknown routes and uncaught
exceptions use the same body.

Invariants: a 500 never carries the exception's text to the client (it is logged with a reference
id that the message names); a 429 always carries ``Retry-After`` in whole seconds (at least 1);
every error body has all four keys, ``param`` and ``code`` possibly null.
"""

from __future__ import annotations

import logging
import math
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.errors import ContextLengthError, QueueFullError

logger = logging.getLogger("pdserve.router")


class APIError(Exception):
    """An error with its HTTP status and OpenAI-shaped body."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def context_too_long(message: str) -> APIError:
    return APIError(400, message, param="messages", code="context_length_exceeded")


def unauthorized() -> APIError:
    return APIError(401, "Invalid or missing API key. Send it as 'Authorization: Bearer <key>'.",
                    type="authentication_error", code="invalid_api_key")


def model_not_found(name: str) -> APIError:
    return APIError(404, f"The model {name!r} does not exist.", param="model", code="model_not_found")


def not_stored(response_id: str) -> APIError:
    """``GET /v1/responses/{id}``: responses are never stored here (docs/responses.md)."""
    return APIError(404, f"No response found with id {response_id!r}: responses are not stored on this "
                         "server (store is accepted and has no effect).", param="response_id", code="not_found")


def body_too_large(limit: int) -> APIError:
    return APIError(413, f"Request body is larger than {limit} bytes.", code="request_too_large")


def queue_full(retry_after_s: float) -> APIError:
    seconds = max(1, math.ceil(retry_after_s))
    return APIError(429, "The server is overloaded; retry later.", type="rate_limit_error",
                    code="rate_limit_exceeded", headers={"Retry-After": str(seconds)})


def unavailable(message: str = "The service is not ready.") -> APIError:
    return APIError(503, message, type="service_unavailable", code="service_unavailable")


def draining(retry_after_s: float = 5.0) -> APIError:
    """``/ready`` of an app being drained: look elsewhere (``Retry-After``: come back after that)."""
    return APIError(503, "This app is draining: it finishes what is in flight and takes no new traffic from "
                    "the load balancer.", type="service_unavailable", code="draining",
                    headers={"Retry-After": str(max(1, math.ceil(retry_after_s)))})


def internal(exc: BaseException | None = None) -> APIError:
    ref = uuid.uuid4().hex[:12]
    if exc is not None:
        logger.error("internal error %s: %r", ref, exc, exc_info=exc)
    return APIError(500, f"Internal server error (reference {ref}).", type="server_error",
                    code="internal_error")


def from_validation_errors(errors: Sequence[Any]) -> APIError:
    """Pydantic / FastAPI validation errors → one 400 naming the first bad field."""
    if not errors:
        return bad_request("Invalid request.")
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body",)]
    param = ".".join(loc) or None
    msg = str(first.get("msg", "invalid value"))
    return bad_request(f"{param}: {msg}" if param else msg, param=param)


def _cause(exc: BaseException) -> BaseException:
    """The user-level exception inside a Ray task error (Ray wraps what a replica raised)."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, BaseException) else exc


def from_exception(exc: BaseException) -> APIError:
    """Map anything a handle call or the engine raised to the error the client should see."""
    from ray.serve.exceptions import BackPressureError  # lazily: keeps this module cheap to import

    inner = _cause(exc)
    if isinstance(exc, APIError):
        return exc
    if isinstance(inner, QueueFullError):
        return queue_full(inner.retry_after_s)
    if isinstance(exc, BackPressureError):
        return queue_full(1.0)
    if isinstance(inner, ContextLengthError):
        return context_too_long(str(inner))
    return internal(exc)


async def _api_error_handler(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return exc.response()


async def _validation_handler(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return from_validation_errors(exc.errors()).response()


async def _http_handler(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    return APIError(exc.status_code, str(exc.detail), type=kind).response()


async def _unhandled_handler(_: Request, exc: Exception) -> JSONResponse:
    return internal(exc).response()


def install_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error_handler)
    app.add_exception_handler(RequestValidationError, _validation_handler)
    app.add_exception_handler(StarletteHTTPException, _http_handler)
    app.add_exception_handler(Exception, _unhandled_handler)
