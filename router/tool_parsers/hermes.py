"""Hermes-style tool calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

Owns: `HermesParser`, registered as ``hermes``: the format of Hermes 2 Pro, Qwen2.5 / Qwen3 and the
SmolLM-family tool templates, recognised by a template that writes both markers.

Text outside the markers is content (a marker split across pieces is held back until it is
decided); each call's body is one JSON object with a ``name`` and an ``arguments`` object
(``parameters`` is read as well: some fine-tunes write it). A body that is not such an object goes
back to the content with its markers; a call the output ends inside (no closing marker: the model
stopped right after the JSON) is parsed as far as it goes, as vLLM's hermes parser does.
"""

from __future__ import annotations

import json

from router.tool_parsers.base import Piece, ToolCallParser, call_from_object, held_back, register

START, END = "<tool_call>", "</tool_call>"


@register("hermes")
class HermesParser(ToolCallParser):
    markers = (START, END)

    def __init__(self) -> None:
        self._buf = ""
        self._in_call = False

    @classmethod
    def teaches(cls, template: str) -> bool:
        return START in template and END in template

    def feed(self, text: str) -> list[Piece]:
        self._buf += text
        out: list[Piece] = []
        while True:
            if not self._in_call:
                at = self._buf.find(START)
                if at < 0:
                    cut = len(self._buf) - held_back(self._buf, START)
                    out.append(self._buf[:cut])
                    self._buf = self._buf[cut:]
                    return out
                out.append(self._buf[:at])
                self._buf = self._buf[at + len(START):]
                self._in_call = True
            else:
                at = self._buf.find(END)
                if at < 0:
                    return out
                out.append(_call(self._buf[:at], END))
                self._buf = self._buf[at + len(END):]
                self._in_call = False

    def finish(self) -> list[Piece]:
        rest, self._buf = self._buf, ""
        if self._in_call:
            self._in_call = False
            return [_call(rest, "")]
        return [rest]


def _call(body: str, end: str) -> Piece:
    """The call in ``body``, or the body back as text with its markers."""
    try:
        obj = json.loads(body)
    except ValueError:
        obj = None
    call = call_from_object(obj, ("arguments", "parameters"))
    return call if call is not None else START + body + end
