"""Deltas → OpenAI chunks (streaming) or one response (not streaming), for both endpoints.

Owns: `Formatter` and its two kinds, `CompletionFormatter` and `ChatFormatter`, plus the SSE
framing (`sse`, `DONE`).

Invariants: one formatter per request; every chunk of a request has the same ``id``, ``created``
and ``model``; a chat stream's first chunk carries ``role: "assistant"``; the usage chunk (only
with ``stream_options.include_usage``) comes last, after the chunk with the finish reason, and has
``choices: []``; logprobs are only those of the chosen tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from router.codec import TextCodec
from router.generation import Delta
from router.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatStreamChoice,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionResponse,
    Usage,
    new_id,
    now,
)

DONE = "data: [DONE]\n\n"


def sse(payload: BaseModel | dict[str, Any]) -> str:
    body = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {body}\n\n"


@dataclass
class Formatter:
    model: str
    codec: TextCodec
    prompt_tokens: int
    logprobs: bool
    include_usage: bool = False
    created: int = field(default_factory=now)
    completion_tokens: int = 0
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    finish_reason: str | None = None
    id: str = ""

    def __post_init__(self) -> None:  # declared here so the dataclass __init__ calls the subclasses' own
        pass

    def add(self, delta: Delta) -> None:
        self.completion_tokens += len(delta.token_ids)
        self.text.append(delta.text)
        self.token_ids.extend(delta.token_ids)
        self.token_logprobs.extend(delta.logprobs)
        self.finish_reason = delta.finish_reason or self.finish_reason

    @property
    def usage(self) -> Usage:
        return Usage.of(self.prompt_tokens, self.completion_tokens)

    def chunk(self, delta: Delta) -> BaseModel:
        raise NotImplementedError

    def usage_chunk(self) -> BaseModel:
        raise NotImplementedError

    def response(self) -> BaseModel:
        raise NotImplementedError


class CompletionFormatter(Formatter):
    def __post_init__(self) -> None:
        self.id = self.id or new_id("cmpl")
        self._offset = 0

    def _logprobs(self, ids: tuple[int, ...] | list[int], lps: tuple[float | None, ...] | list[float | None],
                  offset: int) -> CompletionLogprobs | None:
        if not self.logprobs:
            return None
        out = CompletionLogprobs()
        for tid, lp in zip(ids, lps, strict=False):
            tok = self.codec.token_text(tid)
            out.tokens.append(tok)
            out.token_logprobs.append(lp)
            out.text_offset.append(offset)
            offset += len(tok)
        return out

    def chunk(self, delta: Delta) -> BaseModel:
        self.add(delta)
        lp = self._logprobs(delta.token_ids, delta.logprobs, self._offset)
        self._offset += len(delta.text)
        choice = CompletionChoice(text=delta.text, logprobs=lp, finish_reason=delta.finish_reason)
        return CompletionChunk(id=self.id, created=self.created, model=self.model, choices=[choice])

    def usage_chunk(self) -> BaseModel:
        return CompletionChunk(id=self.id, created=self.created, model=self.model, choices=[],
                               usage=self.usage)

    def response(self) -> BaseModel:
        choice = CompletionChoice(text="".join(self.text), finish_reason=self.finish_reason,
                                  logprobs=self._logprobs(self.token_ids, self.token_logprobs, 0))
        return CompletionResponse(id=self.id, created=self.created, model=self.model, choices=[choice],
                                  usage=self.usage)


class ChatFormatter(Formatter):
    def __post_init__(self) -> None:
        self.id = self.id or new_id("chatcmpl")
        self._sent_role = False

    def _logprobs(self, ids: tuple[int, ...] | list[int],
                  lps: tuple[float | None, ...] | list[float | None]) -> ChatLogprobs | None:
        if not self.logprobs:
            return None
        content = []
        for tid, lp in zip(ids, lps, strict=False):
            tok = self.codec.token_text(tid)
            content.append(ChatTokenLogprob(token=tok, logprob=lp if lp is not None else 0.0,
                                            bytes=list(tok.encode())))
        return ChatLogprobs(content=content)

    def chunk(self, delta: Delta) -> BaseModel:
        self.add(delta)
        first = not self._sent_role
        self._sent_role = True
        choice = ChatStreamChoice(delta=ChatDelta(role="assistant" if first else None, content=delta.text),
                                  logprobs=self._logprobs(delta.token_ids, delta.logprobs),
                                  finish_reason=delta.finish_reason)
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[choice])

    def usage_chunk(self) -> BaseModel:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[],
                                   usage=self.usage)

    def response(self) -> BaseModel:
        choice = ChatChoice(message=AssistantMessage(content="".join(self.text)),
                            logprobs=self._logprobs(self.token_ids, self.token_logprobs),
                            finish_reason=self.finish_reason)
        return ChatCompletionResponse(id=self.id, created=self.created, model=self.model, choices=[choice],
                                      usage=self.usage)
