"""A chat request's tools, checked against the model: what the template renders, what is parsed.

Owns: `ToolPlan` (per request: the mode, the tools handed to the chat template, the output parser,
the JSON schema a forced call is constrained to) and `plan_tools`, which builds it or refuses the
request with a 400 naming the field at fault; `required_schema`, the output schema of
``tool_choice: required`` (a named function's is its ``parameters``), and `tool_grammar`, that
schema as the request's grammar (`engine.sampling.grammar.GrammarSpec`), checked against the tokenizer.

Modes (``tool_choice``; without one, ``auto`` when there are tools, else ``none``). The tools are
rendered into the prompt whenever the template renders them; then

- ``none``: the output is plain content, never parsed;
- ``auto``: a template that cannot render tools is a 400 naming ``tools`` (the model cannot be told
  about them); the output is parsed, in the format the template teaches (`router.tool_parsers`),
  into ``tool_calls``;
- ``required``: a grammar constrains the output to calls of the tools (`required_schema`);
- a named function: a grammar constrains the output to that function's ``parameters``: the output
  is its arguments.

Invariants: only ``function`` tools, with distinct names; a named choice names one of them;
``strict`` schemas only where a grammar enforces them (required / named), since under ``auto`` the
arguments are whatever the model wrote; an assistant message's ``tool_calls`` only reach a
template that renders them (else a 400 naming ``messages``, never silently dropped); where the
tokenizer makes a format's markers special tokens, ``auto`` decodes special tokens
(``keep_special_tokens``, as vLLM's parsers do), since a skipped marker would hide every call.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from engine.sampling.grammar import GrammarSpec
from router.codec import TextCodec
from router.errors import APIError, bad_request
from router.messages import ChatMessage
from router.protocol import ChatCompletionRequest
from router.response_format import check_grammar
from router.tool_parsers import PARSERS, parser_for_template

Mode = Literal["none", "auto", "required", "named"]

#: the schema of a function that declares no ``parameters``: it takes none
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True)
class ToolPlan:
    mode: Mode
    template_tools: tuple[dict[str, Any], ...] = ()  # what the template's ``tools`` gets (empty: None)
    parser: str | None = None  # auto: the registered format the output is parsed with
    function: str | None = None  # named: the function the output is the arguments of
    parallel: bool = True  # several calls in one answer (parallel_tool_calls)
    keep_special_tokens: bool = False  # auto: the format's markers are special tokens: decode them
    schema: str | None = None  # required / named: the JSON schema (text) the output must match

    @property
    def reads_calls(self) -> bool:
        """Whether the output becomes ``tool_calls`` (else it is plain content)."""
        return self.mode != "none"


def plan_tools(req: ChatCompletionRequest, codec: TextCodec) -> ToolPlan:
    """The request's `ToolPlan`, or a 400 naming ``tools``, ``tool_choice`` or ``messages``."""
    check_history(req.messages, codec)
    tools = req.tools or []
    params: dict[str, dict[str, Any]] = {}
    strict = False
    for i, tool in enumerate(tools):
        if tool.type != "function" or tool.function is None:
            raise _refuse("tools", f"tools[{i}]: only 'function' tools are supported, got type {tool.type!r}")
        if tool.function.name in params:
            raise _refuse("tools", f"tools[{i}]: the function name {tool.function.name!r} is used twice")
        params[tool.function.name] = tool.function.parameters or NO_PARAMETERS
        strict |= bool(tool.function.strict)
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
    rendered = tuple(t.to_template() for t in tools) if codec.renders_tools else ()
    if choice == "none" or (choice == "auto" and not tools):
        return ToolPlan("none", rendered)
    if not tools:
        raise _refuse("tool_choice", f"tool_choice {_choice_name(choice)} needs tools; the request has none")
    if choice == "auto":
        return _auto(req, codec, rendered, strict)
    if choice == "required":
        return ToolPlan("required", rendered, parallel=req.parallel_tool_calls,
                        schema=json.dumps(required_schema(params, req.parallel_tool_calls)))
    assert not isinstance(choice, str)
    if choice.type != "function":
        raise _refuse("tool_choice", f"tool_choice type {choice.type!r} is not supported; only 'function' is")
    name = choice.function.name
    if name not in params:
        raise _refuse("tool_choice", f"tool_choice names the function {name!r}, which is not among the "
                                     f"tools ({', '.join(sorted(params))})")
    return ToolPlan("named", rendered, function=name, parallel=False, schema=json.dumps(params[name]))


async def tool_grammar(plan: ToolPlan, req: ChatCompletionRequest, codec: TextCodec) -> GrammarSpec | None:
    """The grammar of a forced call (``required`` / named), compiled against the model's tokenizer as
    the pools will compile it: a 400 naming ``tools`` when a parameters schema cannot be enforced,
    one naming ``tool_choice`` when ``response_format`` constrains the output as well."""
    if plan.schema is None:
        return None
    if req.response_format is not None and req.response_format.type != "text":
        raise _refuse("tool_choice", "a forced tool call and response_format both constrain the output; "
                                     "send one of them")
    spec = GrammarSpec("json_schema", plan.schema)
    await check_grammar(spec, codec, param="tools")  # the schemas are the tools' parameters
    return spec


def _auto(req: ChatCompletionRequest, codec: TextCodec, rendered: tuple[dict[str, Any], ...],
          strict: bool) -> ToolPlan:
    if not codec.renders_tools:
        raise _refuse("tools", "the model's chat template does not render tools, so the model cannot be told "
                               "about them (tool_choice 'auto'); use tool_choice 'required' or a named "
                               "function, whose output is constrained to a call, or 'none'")
    parser = parser_for_template(codec.chat_template)
    if parser is None:
        raise _refuse("tools", "the model's chat template renders tools in a tool-call format we cannot parse "
                               f"(tool_choice 'auto'; known formats: {', '.join(PARSERS)}); use "
                               "tool_choice 'required' or a named function")
    if strict:
        raise _refuse("tools", "strict function schemas are enforced only with tool_choice 'required' or a "
                               "named function (a grammar constrains the output); under 'auto' the model's "
                               "calls are parsed, not constrained")
    special = any(codec.is_special_token(m) for m in PARSERS[parser].markers)
    return ToolPlan("auto", rendered, parser=parser, parallel=req.parallel_tool_calls, keep_special_tokens=special)


def check_history(messages: Sequence[ChatMessage], codec: TextCodec) -> None:
    """Earlier tool calls in the history reach the model only through a template that renders them
    (also for ``/tokenize``, whose ids must be a chat completion's)."""
    at = next((i for i, m in enumerate(messages) if m.tool_calls), None)
    if at is not None and "tool_calls" not in (codec.chat_template or ""):
        raise _refuse("messages", f"messages[{at}] has tool_calls, which the model's chat template does "
                                  "not render")


def required_schema(params: dict[str, dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """``{"name": <one of the tools>, "arguments": <its parameters>}``; a non-empty array of those when
    calls may run in parallel."""
    one = {"anyOf": [{"type": "object",
                      "properties": {"name": {"const": name}, "arguments": schema},
                      "required": ["name", "arguments"], "additionalProperties": False}
                     for name, schema in params.items()]}
    return {"type": "array", "items": one, "minItems": 1} if parallel else one


def _choice_name(choice: object) -> str:
    return repr(choice) if isinstance(choice, str) else "(a named function)"


def _refuse(param: str, message: str) -> APIError:
    return bad_request(message, param=param)
