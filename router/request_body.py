"""A request's body, from bytes to a validated request model: what every JSON endpoint reads first.

Owns the steps between auth and the endpoint's own work (`router.app.Router` authorizes first, then
calls `parse_body`): the body read within ``max_body_bytes`` (413, checked as it streams in, so an
oversized body is never held whole), JSON (400), every field accounted for (`router.fields.account`:
refused unless at its default, ignored with a warning), pydantic validation (400 in OpenAI's shape),
and the model name (404 unless it is the served one). Also the request's path without Serve's
route prefix (public paths are matched on it) and which of vLLM's two ``/tokenize`` bodies a
payload is.

Invariants: every refusal is raised as a `router.errors.APIError` (the app's handlers answer it);
nothing here formats a response or touches a backend.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from router.errors import bad_request, body_too_large, from_validation_errors, model_not_found
from router.fields import FieldTables, account
from router.tokenize import TokenizeChatRequest, TokenizeCompletionRequest

M = TypeVar("M", bound=BaseModel)


async def read_json(request: Request, limit: int) -> Any:
    """The body as JSON; 413 past ``limit`` bytes (checked as it streams in), 400 if not JSON."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise body_too_large(limit)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise body_too_large(limit)
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise bad_request(f"The request body is not valid JSON: {e}") from None


async def parse_body(request: Request, pick: Callable[[Any], type[M]], limit: int, served_model_name: str,
                     fields: FieldTables | None = None) -> M:
    """The body (size, JSON), every field accounted for, validation, the model name (when the body
    names one). ``pick``: the request model for this body; ``fields``: the endpoint's refused and
    ignored fields (default: chat's and completions')."""
    payload = await read_json(request, limit)
    model = pick(payload)
    refused_fields, ignored_fields = fields or (None, None)
    account(payload, frozenset(model.model_fields), refused_fields, ignored_fields)
    try:
        req = model.model_validate(payload)
    except ValidationError as e:
        raise from_validation_errors(e.errors()) from None
    name = getattr(req, "model", None)
    if name is not None and name != served_model_name:
        raise model_not_found(name)
    return req


def route_path(request: Request) -> str:
    """The path as the app sees it, without Serve's route prefix (``/pd/health`` → ``/health``)."""
    path: str = request.scope.get("path", "")
    root: str = request.scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


def tokenize_kind(payload: Any) -> type[TokenizeCompletionRequest | TokenizeChatRequest]:
    """vLLM's two ``/tokenize`` bodies: chat-style when it has ``messages``."""
    chat = isinstance(payload, dict) and "messages" in payload
    return TokenizeChatRequest if chat else TokenizeCompletionRequest
