"""Deltas → OpenAI chunks (streaming) or one response (not streaming), for both endpoints.

Owns: `Formatter` and its two kinds, `CompletionFormatter` and `ChatFormatter`, plus the SSE
framing (`sse`, `DONE`).

Invariants: one formatter per request; every chunk of a request has the same ``id``, ``created``
and ``model``; a chunk carries one choice, with its ``index`` (``n > 1``: the choices' chunks
interleave, as OpenAI's do); a response lists its ``n`` choices in index order; usage counts the
prompt once and every choice's tokens; a chat stream's first chunk of each choice carries
``role: "assistant"``; the usage chunk (only with ``stream_options.include_usage``) comes last,
after the chunks with the finish reasons, and has ``choices: []``; logprobs are the chosen tokens'
and, when asked, the most likely alternatives (chat: ``top_logprobs`` objects; completions: a
``{token: logprob}`` dict per token, the chosen one included); completions' ``echo`` puts the
prompt's text (with ``logprobs``: its tokens) first in each choice's first chunk, and a request
that asks for prompt log-probs gets vLLM's ``prompt_logprobs`` in its response (each choice of a
completion, the response of a chat; `router.prompt_logprobs`). A chat answer read for tool calls
(a `ToolCallStream`, one per choice) sends the content and ``tool_calls`` deltas the stream
releases, and its finish reason (``tool_calls`` where calls were made); its log-probs stay those
of every generated token.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from engine.sampling.prompt_logprobs import PromptLogprobs
from engine.sampling.sampler import TopLogprobs
from router.codec import TextCodec
from router.generation import Delta
from router.openai_objects import (
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
from router.prompt_logprobs import PromptLogprobsList, echoed_entries, vllm_prompt_logprobs
from router.tool_protocol import DeltaToolCall
from router.tool_stream import ToolCallStream

DONE = "data: [DONE]\n\n"


def sse(payload: BaseModel | dict[str, Any]) -> str:
    body = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {body}\n\n"


def sse_event(event: dict[str, Any]) -> str:
    """A Responses API event: named by its ``type`` (``event:``), the event itself as ``data``."""
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"


@dataclass
class ChoiceText:
    """What one choice has produced so far."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    token_tops: list[TopLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    offset: int = 0  # completions: text offset of the next chunk's first token
    started: bool = False  # its first chunk went out (chat: the role; completions: the echo)
    tools: ToolCallStream | None = None  # chat, read for tool calls: this choice's stream
    released: tuple[str, list[DeltaToolCall]] = ("", [])  # what its last delta released, read for calls


@dataclass
class Formatter:
    model: str
    codec: TextCodec
    prompt_tokens: int
    logprobs: bool
    include_usage: bool = False
    created: int = field(default_factory=now)
    completion_tokens: int = 0  # every choice's
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (the prefill replica's count)
    top_logprobs: int = 0  # alternatives per token the request asked for (with logprobs)
    id: str = ""
    echo: str = ""  # completions' ``echo``: the prompt's text, sent before the completion's (first chunk)
    echo_logprobs: bool = False  # completions' ``echo`` with ``logprobs``: the prompt's tokens come first
    prompt_ids: tuple[int, ...] = ()  # with prompt log-probs asked: the prompt they score
    prompt_scores: PromptLogprobs | None = None  # the prompt's log-probs, from token 0's delta
    n: int = 1  # choices
    choices: dict[int, ChoiceText] = field(default_factory=dict)

    def __post_init__(self) -> None:  # declared here so the dataclass __init__ calls the subclasses' own
        pass

    def add(self, delta: Delta) -> ChoiceText:
        """Account for a delta; returns its choice."""
        self.completion_tokens += len(delta.token_ids)
        self.cached_tokens = max(self.cached_tokens, delta.cached_tokens)
        c = self.choices.setdefault(delta.index, ChoiceText())
        c.text.append(delta.text)
        c.token_ids.extend(delta.token_ids)
        c.token_logprobs.extend(delta.logprobs)
        c.token_tops.extend(delta.top_logprobs or [()] * len(delta.token_ids))
        c.finish_reason = delta.finish_reason or c.finish_reason
        self.prompt_scores = delta.prompt_logprobs or self.prompt_scores
        return c

    def ordered(self) -> list[tuple[int, ChoiceText]]:
        """Every choice, in index order (one that produced nothing, as empty)."""
        return [(i, self.choices.get(i, ChoiceText())) for i in range(self.n)]

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
        c = self.add(delta)
        ids, lps, tops = self._echoed() if not c.started else ([], [], [])  # the prompt's first
        lp = self._logprobs([*ids, *delta.token_ids], [*lps, *delta.logprobs],
                            [*tops, *(delta.top_logprobs or [()] * len(delta.token_ids))], c.offset)
        c.offset += len(delta.text) + sum(len(self.codec.token_text(t)) for t in ids)
        text = delta.text if c.started else self.echo + delta.text
        c.started = True
        choice = CompletionChoice(index=delta.index, text=text, logprobs=lp, finish_reason=delta.finish_reason)
        return CompletionChunk(id=self.id, created=self.created, model=self.model, choices=[choice])

    def usage_chunk(self) -> BaseModel:
        return CompletionChunk(id=self.id, created=self.created, model=self.model, choices=[],
                               usage=self.usage)

    def response(self) -> BaseModel:
        ids, lps, tops = self._echoed()
        choices = [CompletionChoice(index=i, text=self.echo + "".join(c.text), finish_reason=c.finish_reason,
                                    logprobs=self._logprobs([*ids, *c.token_ids], [*lps, *c.token_logprobs],
                                                            [*tops, *c.token_tops], 0),
                                    prompt_logprobs=self.vllm_prompt_logprobs())
                   for i, c in self.ordered()]
        return CompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices,
                                  usage=self.usage)


@dataclass
class ChatFormatter(Formatter):
    tools: ToolCallStream | None = None  # the answer's text read for tool calls (`router.tool_stream`):
    # a fresh stream, copied for each choice

    def __post_init__(self) -> None:
        self.id = self.id or new_id("chatcmpl")

    def add(self, delta: Delta) -> ChoiceText:
        c = super().add(delta)
        if self.tools is not None:
            if c.tools is None:
                c.tools = copy.deepcopy(self.tools)  # a fresh stream for each choice
            c.released = c.tools.push(delta.text, final=delta.finish_reason is not None)
        return c

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
        c = self.add(delta)
        first = not c.started
        c.started = True
        text, calls = (delta.text, []) if c.tools is None else c.released
        message = ChatDelta(role="assistant" if first else None, content=text if text or not calls else None,
                            tool_calls=calls or None)
        choice = ChatStreamChoice(index=delta.index, delta=message,
                                  logprobs=self._logprobs(delta.token_ids, delta.logprobs, delta.top_logprobs),
                                  finish_reason=self._finish_reason(c, delta.finish_reason))
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[choice])

    def usage_chunk(self) -> BaseModel:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=[],
                                   usage=self.usage)

    @staticmethod
    def _finish_reason(c: ChoiceText, reason: str | None) -> str | None:
        return reason if reason is None or c.tools is None else c.tools.finish_reason(reason)

    def response(self) -> BaseModel:
        choices = []
        for i, c in self.ordered():
            if c.tools is None:
                message = AssistantMessage(content="".join(c.text))
            else:
                message = AssistantMessage(content=c.tools.content, tool_calls=c.tools.calls or None)
            choices.append(ChatChoice(index=i, message=message,
                                      logprobs=self._logprobs(c.token_ids, c.token_logprobs, c.token_tops),
                                      finish_reason=self._finish_reason(c, c.finish_reason)))
        return ChatCompletionResponse(id=self.id, created=self.created, model=self.model, choices=choices,
                                      usage=self.usage, prompt_logprobs=self.vllm_prompt_logprobs())
