"""The output of ``tool_choice: required``: calls as JSON, already constrained by a grammar.

Owns: `ForcedCalls`, which reads ``[{"name": ..., "arguments": {...}}, ...]`` (parallel calls) or
one such object (``parallel_tool_calls: false``), the shapes of `router.tools.required_schema`, and
returns each call as soon as its object closes. Not a model family's format: it is not registered
in `PARSERS` and teaches no template.

The grammar makes the output valid JSON of that shape, so the reader only tracks nesting (strings
and their escapes included) to find where each call's object ends. An output cut short (``length``)
leaves its unfinished object as content, never a call.
"""

from __future__ import annotations

import json

from router.tool_parsers.base import Piece, ToolCallParser, call_from_object


class ForcedCalls(ToolCallParser):
    def __init__(self, parallel: bool) -> None:
        self._base = 1 if parallel else 0  # the nesting depth at which each call's object opens
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._item: list[str] | None = None  # the call being read

    @classmethod
    def teaches(cls, template: str) -> bool:
        return False

    def feed(self, text: str) -> list[Piece]:
        out: list[Piece] = []
        for ch in text:
            if self._item is not None:
                self._item.append(ch)
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "[{":
                if ch == "{" and self._depth == self._base and self._item is None:
                    self._item = [ch]
                self._depth += 1
            elif ch in "]}":
                self._depth -= 1
                if self._item is not None and self._depth == self._base:
                    out.append(self._close())
        return out

    def _close(self) -> Piece:
        body = "".join(self._item or ())
        self._item = None
        try:
            call = call_from_object(json.loads(body), ("arguments",))
        except ValueError:
            call = None
        return call if call is not None else body

    def finish(self) -> list[Piece]:
        rest = "".join(self._item or ())
        self._item = None
        return [rest]
