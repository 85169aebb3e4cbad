"""A chat request's messages: what a client may send, and the dict a chat template gets.

Owns: `ChatMessage` and its `ContentPart`s (`router.protocol`'s chat request and `router.tokenize`'s
chat body hold a list of them).

Invariants: only text content (a string, or ``text`` parts, joined); ``tool_calls`` only on an
assistant message, ``tool_call_id`` on any (a tool message answers a call); a message key we do
not serve (``audio``, ``refusal``, the deprecated ``function_call``...) is refused when it carries a
value, and dropped when empty (a client echoing a response's message back). `to_template` gives
the dict transformers and vLLM hand a template: a key is present only with a value, since
templates test ``'tool_calls' in message``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, field_validator, model_validator

from router.tool_protocol import MessageToolCall


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    function_call: Any | None = None  # the deprecated form of tool_calls: refused

    @model_validator(mode="before")
    @classmethod
    def _no_unserved_keys(cls, data: Any) -> Any:
        """A message key we do not serve (``audio``, ``refusal``...) is refused when it carries a
        value; empty ones (a client echoing a response's message back) are dropped."""
        if isinstance(data, dict):
            for key, value in data.items():
                if key not in cls.model_fields and value not in (None, "", [], {}):
                    raise ValueError(f"the message field {key!r} is not supported")
        return data

    @field_validator("function_call")
    @classmethod
    def _no_function_call(cls, v: Any) -> Any:
        if v:
            raise ValueError("function_call (deprecated) is not supported; send tool_calls")
        return v

    @model_validator(mode="after")
    def _calls_from_the_assistant(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise ValueError(f"tool_calls are an assistant's, not a {self.role} message's")
        return self

    @field_validator("content")
    @classmethod
    def _text_only(cls, v: str | list[ContentPart] | None) -> str | list[ContentPart] | None:
        if isinstance(v, list):
            for part in v:
                if part.type != "text" or part.text is None:
                    raise ValueError(f"only text content parts are supported, got type {part.type!r}")
        return v

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text or "" for p in self.content)

    def to_template(self) -> dict[str, Any]:
        """The ``{"role", "content"}`` dict chat templates expect (developer reads as system), with the
        participant's ``name``, an assistant's ``tool_calls`` (arguments as objects) and a tool
        message's ``tool_call_id`` when given, as transformers and vLLM hand them to templates (a key
        is present only with a value: templates test ``'tool_calls' in message``)."""
        role = "system" if self.role == "developer" else self.role
        out: dict[str, Any] = {"role": role, "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [c.to_template() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out
