"""Llama 3's JSON tool calls: the whole answer is ``{"name": ..., "parameters": {...}}``.

Owns: `Llama3JsonParser`, registered as ``llama3_json``: the custom-tool format of the Llama 3.1 /
3.2 / 3.3 chat templates (recognised by the format sentence they write: ``{"name": function name,
"parameters": dictionary of argument name and its value}``).

An output is a call only as a whole, as vLLM's ``llama3_json`` parser reads it: after leading
whitespace (and an optional ``<|python_tag|>``) it starts with ``{``, and it is one or more JSON
objects separated by ``;``, each with a ``name`` and a ``parameters`` (or ``arguments``) object.
Anything else is content. So the output is streamed as content as soon as it cannot be a call,
and held whole (nothing sent) while it still can, until the end decides.
"""

from __future__ import annotations

import json

from router.tool_parsers.base import Piece, ToolCallParser, call_from_object, register

PYTHON_TAG = "<|python_tag|>"
FORMAT = '{"name": function name, "parameters": dictionary of argument name and its value}'


@register("llama3_json")
class Llama3JsonParser(ToolCallParser):
    def __init__(self) -> None:
        self._buf = ""
        self._state = "undecided"  # → "prose" (streamed as it comes) or "json" (held to the end)

    @classmethod
    def teaches(cls, template: str) -> bool:
        return FORMAT in template

    def feed(self, text: str) -> list[Piece]:
        if self._state == "prose":
            return [text]
        self._buf += text
        if self._state == "undecided":
            head = self._buf.lstrip()
            if head.startswith(("{", PYTHON_TAG)):
                self._state = "json"
            elif head and not PYTHON_TAG.startswith(head):
                self._state = "prose"
                out, self._buf = self._buf, ""
                return [out]
        return []

    def finish(self) -> list[Piece]:
        rest, self._buf = self._buf, ""
        if self._state != "json":
            return [rest]
        calls = _calls(rest)
        return [rest] if calls is None else list(calls)


def _calls(text: str) -> list[Piece] | None:
    """``{...}; {...}`` → the calls, or None unless every part is one."""
    body = text.strip().removeprefix(PYTHON_TAG).strip()
    decoder = json.JSONDecoder()
    calls: list[Piece] = []
    at = 0
    while True:
        try:
            obj, at = decoder.raw_decode(body, at)
        except ValueError:
            return None
        call = call_from_object(obj, ("parameters", "arguments"))
        if call is None:
            return None
        calls.append(call)
        rest = body[at:].lstrip()
        if not rest:
            return calls
        if not rest.startswith(";"):
            return None
        at = len(body) - len(rest[1:].lstrip())
