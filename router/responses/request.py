"""The Responses API request as we serve it: `ResponsesRequest` and its input items.

Owns: the request model of ``POST /v1/responses`` (the fields we serve; `router.responses.fields`
accounts for the others before this model sees the body) and the input items it takes: a message
(``type: "message"`` or no type, as the client's "easy" messages have), an earlier
``function_call`` and a ``function_call_output``; function tools (`ResponsesTool`, OpenAI's flat
shape), ``tool_choice`` and ``text.format``.

Invariants: ``input`` is a non-empty string or a non-empty list of those three item kinds, with
text content only (``input_text`` / ``output_text`` parts); any other item or part type is a
validation error naming ``input`` and the type; a ``function_call``'s ``arguments`` is JSON text;
``text.verbosity`` is ``medium`` or absent. What needs the tokenizer or the chat template (tool
types, a named choice among the tools, what the template renders) is checked on the chat request
it becomes (`router.responses.convert`, `router.tools`), so its 400s name ``tools`` or
``tool_choice``; so is ``slo_class`` (pdserve's extension, as on chat), classified on the chat path
(`router.request_objective`), so a class not configured is a 400 naming ``slo_class``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from router.tool_protocol import FUNCTION_NAME, json_text

TEXT_PARTS = ("input_text", "output_text")
ITEM_TYPES = ("message", "function_call", "function_call_output")


class TextPart(BaseModel):
    """``input_text`` (a user / system message's) or ``output_text`` (an earlier answer sent back)."""

    model_config = ConfigDict(extra="ignore")  # annotations, logprobs of an echoed output_text
    type: str
    text: str

    @field_validator("type")
    @classmethod
    def _text_only(cls, v: str) -> str:
        if v not in TEXT_PARTS:
            raise ValueError(f"only text content parts ({', '.join(TEXT_PARTS)}) are supported, got {v!r}")
        return v


def _joined(content: str | list[TextPart]) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content)


class MessageItem(BaseModel):
    model_config = ConfigDict(extra="ignore")  # id, status, phase of an echoed output message
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[TextPart]

    @property
    def text(self) -> str:
        return _joined(self.content)


class FunctionCallItem(BaseModel):
    """An earlier call of the model's, sent back with its output."""

    model_config = ConfigDict(extra="ignore")  # id, status of an echoed output item
    type: Literal["function_call"]
    call_id: str
    name: str = Field(pattern=FUNCTION_NAME)
    arguments: str

    _json = field_validator("arguments")(json_text)


class FunctionCallOutputItem(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[TextPart]

    @property
    def text(self) -> str:
        return _joined(self.output)


InputItem = Annotated[MessageItem | FunctionCallItem | FunctionCallOutputItem, Field(discriminator="type")]


class ResponsesTool(BaseModel):
    """OpenAI's flat function tool (``{"type": "function", "name", "parameters", ...}``); any other
    type (``web_search``, ``file_search``, ``mcp``...) is refused by `router.responses.convert`."""

    model_config = ConfigDict(extra="ignore")
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedChoice(BaseModel):
    """``{"type": "function", "name": ...}``; other types are refused by `router.responses.convert`."""

    model_config = ConfigDict(extra="ignore")
    type: str
    name: str | None = None


class TextFormat(BaseModel):
    """``text.format``: ``text``, ``json_object`` or ``json_schema`` (flat: ``name``, ``schema``,
    ``description``, ``strict``); shapes are checked as chat's ``response_format`` is."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    type: str
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")
    format: TextFormat | None = None
    verbosity: str | None = None

    @field_validator("verbosity")
    @classmethod
    def _medium(cls, v: str | None) -> str | None:
        if v not in (None, "medium"):
            raise ValueError(f"verbosity is not adjustable; only 'medium', got {v!r}")
        return v


class ResponsesRequest(BaseModel):
    """``POST /v1/responses``."""

    model_config = ConfigDict(extra="ignore")

    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    tools: list[ResponsesTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool | None = None
    store: bool | None = None  # accepted either way: nothing is stored
    metadata: dict[str, str] | None = None  # echoed in the response
    user: str | None = None  # echoed in the response
    # pdserve's extension, as on chat: the objective class it is judged by (`router.request_objective`)
    slo_class: str | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _items(cls, v: Any) -> Any:
        """Items without a ``type`` are messages (the client's easy form); other types are named."""
        if isinstance(v, str) and not v:
            raise ValueError("input must not be empty")
        if not isinstance(v, list):
            return v
        if not v:
            raise ValueError("input must not be empty")
        out = []
        for i, item in enumerate(v):
            if isinstance(item, dict):
                kind = item.get("type") or "message"
                if kind not in ITEM_TYPES:
                    raise ValueError(f"input[{i}]: item type {kind!r} is not supported; only "
                                     f"{', '.join(ITEM_TYPES)}")
                item = {**item, "type": kind}
            out.append(item)
        return out
