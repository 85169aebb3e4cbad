"""A Responses request as the chat completions request it means, so one path serves both.

Owns: `to_chat`, which turns a validated `ResponsesRequest` into a `ChatCompletionRequest`; the app
then plans its tools, renders its prompt and builds its sampling settings exactly as for
``/v1/chat/completions`` (`router.tools`, `router.prompt`, `router.response_format`).

The mapping (OpenAI's meaning of each field; vLLM's Responses server maps them the same way):

- ``instructions`` → a leading ``system`` message; a string ``input`` → one ``user`` message;
- a ``message`` item → a message of its role with its text; ``function_call`` items → the
  ``tool_calls`` of an assistant message (joined to the assistant message just before them, if
  any, else a new one with no content); a ``function_call_output`` → a ``tool`` message answering
  its ``call_id``;
- ``tools`` (function, flat) → chat's ``{"type": "function", "function": {...}}``; ``tool_choice``
  ``{"type": "function", "name"}`` → chat's named choice; ``parallel_tool_calls`` as is;
- ``text.format`` → ``response_format`` (``json_schema``'s flat ``name`` / ``schema`` /
  ``description`` / ``strict`` nested under ``json_schema``);
- ``max_output_tokens`` → ``max_completion_tokens``; ``temperature``, ``top_p``, ``stream`` as
  they are, and only when sent (the model's generation config fills what is absent, as for chat);
- ``slo_class`` (pdserve's extension) as it is: the chat path classifies the request
  (`router.request_objective`), so a class the objectives do not have is the same 400 naming
  ``slo_class`` on both endpoints.

Invariants: only function tools and function tool choices pass (a built-in tool is a 400 naming
``tools``, another choice type one naming ``tool_choice``); a field of the chat request that fails
validation is reported under the Responses field it came from (``messages`` → ``input``,
``response_format`` → ``text``).
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from router.errors import APIError, bad_request, from_validation_errors
from router.protocol import ChatCompletionRequest
from router.responses.request import (
    FunctionCallItem,
    FunctionCallOutputItem,
    NamedChoice,
    ResponsesRequest,
    ResponsesTool,
)

#: a chat field → the Responses field it came from (for the ``param`` of a 400)
_SOURCE = {"messages": "input", "response_format": "text", "max_completion_tokens": "max_output_tokens"}


def to_chat(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat completions request ``req`` means (see the module docstring), or a 400."""
    body: dict[str, Any] = {"model": req.model, "messages": _messages(req), "stream": bool(req.stream)}
    if req.max_output_tokens is not None:
        body["max_completion_tokens"] = req.max_output_tokens
    if req.temperature is not None:
        body["temperature"] = req.temperature
    if req.top_p is not None:
        body["top_p"] = req.top_p
    if req.tools:
        body["tools"] = [_tool(i, t) for i, t in enumerate(req.tools)]
    if req.tool_choice is not None:
        body["tool_choice"] = _choice(req.tool_choice)
    if req.parallel_tool_calls is not None:
        body["parallel_tool_calls"] = req.parallel_tool_calls
    if req.slo_class is not None:
        body["slo_class"] = req.slo_class
    fmt = req.text.format if req.text is not None else None
    if fmt is not None:
        body["response_format"] = _response_format(fmt.model_dump(by_alias=True, exclude_none=True))
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        raise _renamed(from_validation_errors(e.errors())) from None


def _messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if req.instructions:
        out.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        return [*out, {"role": "user", "content": req.input}]
    for item in req.input:
        if isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text})
        else:
            out.append({"role": item.role, "content": item.text})
    return out


def _tool(i: int, tool: ResponsesTool) -> dict[str, Any]:
    if tool.type != "function":
        raise bad_request(f"tools[{i}]: built-in tools such as {tool.type!r} are not supported; only "
                          "'function' tools", param="tools")
    if tool.name is None:
        raise bad_request(f"tools[{i}]: a function tool needs a name", param="tools")
    function = tool.model_dump(exclude={"type"}, exclude_none=True)
    return {"type": "function", "function": function}


def _choice(choice: str | NamedChoice) -> str | dict[str, Any]:
    if isinstance(choice, str):
        return choice
    if choice.type != "function" or choice.name is None:
        raise bad_request(f"tool_choice type {choice.type!r} is not supported; only 'none', 'auto', "
                          "'required' or {'type': 'function', 'name': ...}", param="tool_choice")
    return {"type": "function", "function": {"name": choice.name}}


def _response_format(fmt: dict[str, Any]) -> dict[str, Any]:
    if fmt.get("type") != "json_schema":
        return {k: v for k, v in fmt.items() if k == "type"}
    return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}


def _renamed(err: APIError) -> APIError:
    head = (err.param or "").partition(".")[0]
    if head not in _SOURCE:
        return err
    param = _SOURCE[head]
    message = err.message.replace(err.param or "", param, 1)
    return bad_request(message, param=param)
