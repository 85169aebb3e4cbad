"""The Response object and its output items, field for field as the official client reads them.

Owns: `ResponseObject` (``object: "response"``), its output items (`OutputMessage` with
`OutputText` parts, `FunctionCallOutput` for a call the model made), `ResponseUsage`, and
`new_response`, the skeleton of a request's response: its id, the request's settings echoed back
(instructions, tools, tool_choice, text, temperature, top_p, max_output_tokens, metadata, user),
status ``in_progress`` and no output yet.

Invariants: ids are ``resp_…`` (a response), ``msg_…`` (a message item), ``fc_…`` (a function
call item) and ``call_…`` (the call id a ``function_call_output`` answers); a response is
``completed``, or ``incomplete`` with ``incomplete_details.reason = "max_output_tokens"`` when the
token bound cut it (its last item is then ``incomplete`` too); nothing here is stored
(``previous_response_id`` is always null, ``store`` is not echoed).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, Field

from router.responses.request import ResponsesRequest

Status = Literal["in_progress", "completed", "incomplete", "failed"]
ItemStatus = Literal["in_progress", "completed", "incomplete"]


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str = ""
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: ItemStatus = "in_progress"
    content: list[OutputText] = Field(default_factory=list)


class FunctionCallOutput(BaseModel):
    """A call the model made: ``call_id`` is what the client's ``function_call_output`` answers."""

    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str = ""  # JSON text
    status: ItemStatus = "in_progress"


OutputItem = OutputMessage | FunctionCallOutput


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    cache_write_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)

    @classmethod
    def of(cls, input_tokens: int, output_tokens: int, cached_tokens: int = 0) -> ResponseUsage:
        return cls(input_tokens=input_tokens, output_tokens=output_tokens, total_tokens=input_tokens + output_tokens,
                   input_tokens_details=InputTokensDetails(cached_tokens=cached_tokens))


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Status = "in_progress"
    error: dict[str, Any] | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    temperature: float | None = None
    top_p: float | None = None
    tool_choice: Any = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    user: str | None = None
    previous_response_id: None = None
    reasoning: None = None
    background: bool = False


def new_response(req: ResponsesRequest) -> ResponseObject:
    """The request's response before any output: its settings echoed back, status ``in_progress``."""
    text: dict[str, Any] = {"format": {"type": "text"}}
    if req.text is not None and req.text.format is not None:
        text = {"format": req.text.format.model_dump(by_alias=True, exclude_none=True)}
    return ResponseObject(
        id=new_id("resp"), created_at=int(time.time()), model=req.model, instructions=req.instructions,
        max_output_tokens=req.max_output_tokens,
        parallel_tool_calls=req.parallel_tool_calls if req.parallel_tool_calls is not None else True,
        temperature=req.temperature, top_p=req.top_p,
        tool_choice=(req.tool_choice.model_dump(exclude_none=True) if req.tool_choice is not None
                     and not isinstance(req.tool_choice, str) else req.tool_choice or "auto"),
        tools=[t.model_dump() for t in req.tools or []],
        text=text, metadata=dict(req.metadata or {}), user=req.user)
