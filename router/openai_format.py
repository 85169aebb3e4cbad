"""Deltas → OpenAI chunks (streaming) or one response (not streaming), for both endpoints.

Owns: `Formatter` and its two kinds, `CompletionFormatter` and `ChatFormatter`, plus the SSE
framing (`sse`, `DONE`).

Invariants: one formatter per request; every chunk of a request has the same ``id``, ``created``
and ``model``; a chat stream's first chunk carries ``role: "assistant"``; the usage chunk (only
with ``stream_options.include_usage``) comes last, after the chunk with the finish reason, and has
``choices: []``; logprobs are the chosen tokens' and, when asked, the most likely alternatives
(chat: ``top_logprobs`` objects; completions: a ``{token: logprob}`` dict per token, the chosen one
included); completions' ``echo`` with ``logprobs`` puts the prompt's tokens first (in the first
chunk), and a request that asks for prompt log-probs gets vLLM's ``prompt_logprobs`` in its
response (`router.prompt_logprobs`). A chat answer read for tool calls (a `ToolCallStream`) sends the content and
``tool_calls`` deltas the stream releases, and its finish reason (``tool_calls`` where calls were
made); its log-probs stay those of every generated token.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from engine.prompt_logprobs import PromptLogprobs
from engine.sampling import TopLogprobs
from router.codec import TextCodec
from router.generation import Delta
from router.prompt_logprobs import PromptLogprobsList, echoed_entries, vllm_prompt_logprobs
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
    TopLogprob,
    Usage,
    new_id,
    now,
)
from router.tool_protocol import DeltaToolCall
from router.tool_stream import ToolCallStream

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
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (the prefill replica's count)
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: int = 0  # alternatives per token the request asked for (with logprobs)
    token_tops: list[TopLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    id: str = ""
    echo: str = ""  # completions' ``echo``: the prompt's text, sent before the completion's (first chunk)
    echo_logprobs: bool = False  # completions' ``echo`` with ``logprobs``: the prompt's tokens come first
    prompt_ids: tuple[int, ...] = ()  # with prompt log-probs asked: the prompt they score
    prompt_scores: PromptLogprobs | None = None  # the prompt's log-probs, from token 0's delta

    def __post_init__(self) -> None:  # declared here so the dataclass __init__ calls the subclasses' own
        pass

    def add(self, delta: Delta) -> None:
        self.completion_tokens += len(delta.token_ids)
        self.cached_tokens = max(self.cached_tokens, delta.cached_tokens)
        self.text.append(delta.text)
        self.token_ids.extend(delta.token_ids)
        self.token_logprobs.extend(delta.logprobs)
        self.token_tops.extend(delta.top_logprobs or [()] * len(delta.token_ids))
        self.finish_reason = delta.finish_reason or self.finish_reason
        self.prompt_scores = delta.prompt_logprobs or self.prompt_scores

    def vllm_prompt_logprobs(self) -> PromptLogprobsList | None:
        """vLLM's ``prompt_logprobs`` of the response, when the request asked for them."""
        if self.prompt_scores is None:
            return None
        return vllm_prompt_logprobs(self.prompt_ids, self.prompt_scores, self.codec)

    @property
    def usage(self) -> Usage:
        return Usage.of(self.prompt_tokens, self.completion_tokens, self.cached_tokens)

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
        self._echoed_text = False

    def _echoed(self) -> tuple[list[int], list[float | None], list[TopLogprobs | None]]:
        """The echoed prompt's tokens, log-probs and alternatives (``echo`` with ``logprobs``), else none."""
        if not self.echo_logprobs or self.prompt_scores is None:
            return [], [], []
        lps, tops = echoed_entries(self.prompt_ids, self.prompt_scores, self.top_logprobs)
        return list(self.prompt_ids), lps, tops

    def _logprobs(self, ids: Sequence[int], lps: Sequence[float | None], tops: Sequence[TopLogprobs | None],
                  offset: int) -> CompletionLogprobs | None:
        if not self.logprobs:
            return None
        out = CompletionLogprobs()
        tops_out: list[dict[str, float] | None] = []  # with k = 0 too: each token alone (as vLLM answers)
        for i, (tid, lp) in enumerate(zip(ids, lps, strict=False)):
            tok = self.codec.token_text(tid)
            out.tokens.append(tok)
            out.token_logprobs.append(lp)
            out.text_offset.append(offset)
            offset += len(tok)
            if lp is None:  # an echoed prompt's first token
                tops_out.append(None)
                continue
            top = {self.codec.token_text(t): v for t, v in (tops[i] or () if i < len(tops) else ())}
            top.setdefault(tok, lp)  # the k most likely, and the chosen token (as vLLM does)
            tops_out.append(top)
        out.top_logprobs = tops_out
        return out

    def chunk(self, delta: Delta) -> BaseModel:
        self.add(delta)
        ids, lps, tops = self._echoed() if not self._echoed_text else ([], [], [])  # the prompt's first
        lp = self._logprobs([*ids, *delta.token_ids], [*lps, *delta.logprobs],
                            [*tops, *(delta.top_logprobs or [()] * len(delta.token_ids))], self._offset)
        self._offset += len(delta.text) + sum(len(self.codec.token_text(t)) for t in ids)
        text = delta.text if self._echoed_text else self.echo + delta.text
        self._echoed_text = True
        choice = CompletionChoice(text=text, logprobs=lp, finish_reason=delta.finish_reason)
        return CompletionChunk(id=self.id, created=self.created, model=self.model, choices=[choice])

    def usage_chunk(self) -> BaseModel:
        return CompletionChunk(id=self.id, created=self.created, model=self.model, choices=[],
                               usage=self.usage)

    def response(self) -> BaseModel:
        ids, lps, tops = self._echoed()
        logprobs = self._logprobs([*ids, *self.token_ids], [*lps, *self.token_logprobs], [*tops, *self.token_tops], 0)
        choice = CompletionChoice(text=self.echo + "".join(self.text), finish_reason=self.finish_reason,
                                  logprobs=logprobs, prompt_logprobs=self.vllm_prompt_logprobs())
        return CompletionResponse(id=self.id, created=self.created, model=self.model, choices=[choice],
                                  usage=self.usage)


@dataclass
class ChatFormatter(Formatter):
    tools: ToolCallStream | None = None  # the answer's text read for tool calls (`router.tool_stream`)

    def __post_init__(self) -> None:
        self.id = self.id or new_id("chatcmpl")
        self._sent_role = False
        self._released: tuple[str, list[DeltaToolCall]] = ("", [])  # the last delta's, read for calls

    def add(self, delta: Delta) -> None:
        super().add(delta)
        if self.tools is not None:
            self._released = self.tools.push(delta.text, final=delta.finish_reason is not None)

    def _logprobs(self, ids: Sequence[int], lps: Sequence[float | None],
                  tops: Sequence[TopLogprobs]) -> ChatLogprobs | None:
        if not self.logprobs:
            return None
        content = []
        for i, (tid, lp) in enumerate(zip(ids, lps, strict=False)):
            tok = self.codec.token_text(tid)
            alts = [self._top(t, v) for t, v in (tops[i] if i < len(tops) else ())]
            content.append(ChatTokenLogprob(token=tok, logprob=lp if lp is not None else 0.0,
                                            bytes=list(tok.encode()), top_logprobs=alts))
        return ChatLogprobs(content=content)

    def _top(self, token_id: int, logprob: float) -> TopLogprob:
        tok = self.codec.token_text(token_id)
        return TopLogprob(token=tok, logprob=logprob, bytes=list(tok.encode()))

    def chunk(self, delta: Delta) -> BaseModel:
        self.add(delta)
        first = not self._sent_role
        self._sent_role = True
        text, calls = (delta.text, []) if self.tools is None else self._released
        message = ChatDelta(role="assistant" if first else None, content=text if text or not calls else None,
                            tool_calls=calls or None)
        choice = ChatStreamChoice(delta=message,
                                  logprobs=self._logprobs(delta.token_ids, delta.logprobs, delta.top_logprobs),
                                  finish_reason=self._finish_reason(delta.finish_reason))
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[choice])

    def usage_chunk(self) -> BaseModel:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[],
                                   usage=self.usage)

    def _finish_reason(self, reason: str | None) -> str | None:
        return reason if reason is None or self.tools is None else self.tools.finish_reason(reason)

    def response(self) -> BaseModel:
        if self.tools is None:
            message = AssistantMessage(content="".join(self.text))
        else:
            message = AssistantMessage(content=self.tools.content, tool_calls=self.tools.calls or None)
        choice = ChatChoice(message=message,
                            logprobs=self._logprobs(self.token_ids, self.token_logprobs, self.token_tops),
                            finish_reason=self._finish_reason(self.finish_reason))
        return ChatCompletionResponse(id=self.id, created=self.created, model=self.model, choices=[choice],
                                      usage=self.usage, prompt_logprobs=self.vllm_prompt_logprobs())
