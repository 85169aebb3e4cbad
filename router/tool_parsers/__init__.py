"""Tool-call output formats, one module each, registered by name in `PARSERS`.

`parser_for_template` picks the format a chat template teaches (the first registered parser whose
`teaches` accepts it, in registration order: ``hermes``, then ``llama3_json``); a template that
teaches none of them gets no parser, and `router.tools` refuses ``tool_choice: auto`` for it.
"""

from __future__ import annotations

from router.tool_parsers import hermes, llama3_json
from router.tool_parsers.base import PARSERS, ParsedCall, Piece, ToolCallParser, merge_text

__all__ = ["PARSERS", "ParsedCall", "Piece", "ToolCallParser", "hermes", "llama3_json", "merge_text",
           "parser_for_template"]


def parser_for_template(template: str | None) -> str | None:
    """The name of the format ``template`` teaches, or None."""
    if template is None:
        return None
    return next((name for name, cls in PARSERS.items() if cls.teaches(template)), None)
