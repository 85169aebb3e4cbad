"""The tool-calling part of OpenAI's chat wire format: tools, tool choice, tool calls.

Owns: the request models (`ToolDef` and its `FunctionDef`, `NamedToolChoice`, `MessageToolCall`: an
assistant's earlier call in the history) and the response models (`ToolCall` in a message,
`DeltaToolCall` in a stream chunk), which `router.protocol` composes into its request and response
models.

Invariants: a function name is OpenAI's ``^[a-zA-Z0-9_-]{1,64}$``; a history call's ``arguments``
is a JSON text (OpenAI's wire form), parsed once here so a template gets the object transformers
expects (`MessageToolCall.to_template`); a `ToolCall`'s ``arguments`` is JSON text too; delta
models serialize only the keys that are set (OpenAI sends ``id``, ``type`` and ``function.name``
once per call, then ``arguments`` pieces). What needs the request as a whole (tool types, a named
choice among the tools, what the template can render) is checked in `router.tools`, so its 400s
name ``tools`` or ``tool_choice``.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    PrivateAttr,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)

FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; absent: takes no arguments
    strict: bool | None = None


class ToolDef(BaseModel):
    """``{"type": "function", "function": {...}}``; other types (``custom``...) are refused by
    `router.tools` with a 400 naming ``tools``."""

    model_config = ConfigDict(extra="ignore")
    type: str
    function: FunctionDef | None = None
    _raw: dict[str, Any] = PrivateAttr(default_factory=dict)

    @model_validator(mode="wrap")
    @classmethod
    def _keep_raw(cls, data: Any, handler: ModelWrapValidatorHandler[ToolDef]) -> ToolDef:
        tool = handler(data)
        if isinstance(data, dict):
            tool._raw = dict(data)
        return tool

    def to_template(self) -> dict[str, Any]:
        """The tool as the client sent it (its keys and their order: templates ``tojson`` it), which
        is what transformers hands a template."""
        return self._raw or self.model_dump(exclude_none=True)


class ChoiceFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str


class NamedToolChoice(BaseModel):
    """``{"type": "function", "function": {"name": ...}}``: that function must be called."""

    model_config = ConfigDict(extra="ignore")
    type: str
    function: ChoiceFunction


def json_text(v: str) -> str:
    """A field validator: ``v`` must parse as JSON (a call's ``arguments``)."""
    try:
        json.loads(v)
    except ValueError as e:
        raise ValueError(f"arguments must be a JSON text: {e}") from None
    return v


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    arguments: str

    _json = field_validator("arguments")(json_text)


class MessageToolCall(BaseModel):
    """An assistant message's earlier tool call, as a client sends the history back."""

    model_config = ConfigDict(extra="ignore")
    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction

    def to_template(self) -> dict[str, Any]:
        """transformers' form: ``arguments`` as the object, not its JSON text (templates ``tojson`` it)."""
        out: dict[str, Any] = {} if self.id is None else {"id": self.id}
        out["type"] = "function"
        out["function"] = {"name": self.function.name, "arguments": json.loads(self.function.arguments)}
        return out


# ---------------------------------------------------------------------------------------- responses


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class _SetKeysOnly(BaseModel):
    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaFunctionCall(_SetKeysOnly):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_SetKeysOnly):
    """One piece of call ``index``: the first carries ``id``, ``type`` and ``function.name``."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None
