"""The objects we answer completions and chat completions with: whole responses and stream chunks.

Owns `CompletionResponse`, `ChatCompletionResponse`, their chunks, `Usage`, log-probs and the model
list, which follow OpenAI's shapes field for field so the official clients parse them; the request
models they answer are in `router.protocol`, the Responses API's objects in `router.responses.objects`.

Invariants: a field we do not compute is absent, not null, where OpenAI's clients would misread a
null: ``prompt_logprobs`` (vLLM's field) only when asked for, a chat message's ``tool_calls`` only when
there are calls, a chunk's delta only with the keys it sets.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, Field, SerializerFunctionWrapHandler, model_serializer

from router.prompt_logprobs import PromptLogprobsList
from router.tool_protocol import DeltaToolCall, ToolCall


def new_id(prefix: str) -> str:
    """``cmpl-…`` / ``chatcmpl-…``: unique, opaque, URL-safe."""
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> Usage:
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)  # None: an echoed prompt's first token
    text_offset: list[int] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] | None = None


def _without_null_prompt_logprobs(handler: SerializerFunctionWrapHandler, model: BaseModel) -> dict[str, Any]:
    """A response's keys, ``prompt_logprobs`` only when computed (vLLM's field, absent from OpenAI's)."""
    out: dict[str, Any] = handler(model)
    if out.get("prompt_logprobs", 0) is None:
        del out["prompt_logprobs"]
    return out


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    prompt_logprobs: PromptLogprobsList | None = None  # vLLM's, when asked (not in stream chunks)

    @model_serializer(mode="wrap")
    def _drop_null_prompt_logprobs(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return _without_null_prompt_logprobs(handler, self)


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] = Field(default_factory=list)


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None

    @model_serializer(mode="wrap")
    def _calls_when_any(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        out: dict[str, Any] = handler(self)
        if out.get("tool_calls") is None:
            out.pop("tool_calls", None)
        return out


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
    prompt_logprobs: PromptLogprobsList | None = None  # vLLM's, when asked

    @model_serializer(mode="wrap")
    def _drop_null_prompt_logprobs(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return _without_null_prompt_logprobs(handler, self)


class ChatDelta(BaseModel):
    """Only the keys that are set, as OpenAI sends them (``role`` in the first chunk alone)."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatStreamChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pdserve"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
