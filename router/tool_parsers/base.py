"""What a tool-call parser is, and the registry of parsers by name.

Owns: `ParsedCall` (one call: a function name and its arguments as JSON text), `Piece` (message
text or a whole call), the `ToolCallParser` base class, `PARSERS` and `register`, and the helpers
the formats share (`call_from_object`, `held_back`).

A parser reads a model's output as it streams (`feed` each new piece of text, then `finish`) and
returns, in order, the text that belongs to the message's ``content`` and the calls it recognised.
A call is returned whole, once its JSON is complete and valid: until then nobody knows whether the
text is a call or prose, and text that looked like a call but does not parse (malformed JSON, no
``name``, arguments that are not an object) is returned as content, never dropped.

Invariants: the pieces returned for an output do not depend on how it was cut into `feed` calls
(what an incomplete marker could still become is held back until it is decided; compare them
through `merge_text`); all text outside recognised calls comes back as content, in order; a parser
reads one output only.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # the arguments object as JSON text (``json.dumps``, non-ASCII kept)


Piece = str | ParsedCall  # message text, or one whole call


class ToolCallParser(ABC):
    """One model family's tool-call format, fed one output's text incrementally."""

    #: text the format needs to see in the output (a tokenizer that makes one of them a special token
    #: must decode without skipping special tokens, or the parser never sees it)
    markers: tuple[str, ...] = ()

    @classmethod
    @abstractmethod
    def teaches(cls, template: str) -> bool:
        """Whether a chat template teaches the model this format (so its output is parsed with it)."""

    @abstractmethod
    def feed(self, text: str) -> list[Piece]:
        """The pieces decided by ``text`` (appended to what came before)."""

    @abstractmethod
    def finish(self) -> list[Piece]:
        """The rest, at the end of the output: a call left open is parsed as far as it goes."""

    def parse(self, text: str) -> list[Piece]:
        """A whole output at once (the same pieces as feeding it in any split)."""
        return merge_text([*self.feed(text), *self.finish()])


#: Every parser by its name; `router.tools` picks the first whose `teaches` accepts the template.
PARSERS: dict[str, type[ToolCallParser]] = {}


def register(name: str) -> Callable[[type[ToolCallParser]], type[ToolCallParser]]:
    """Add a parser under ``name`` (a new format is one module and this decorator)."""

    def add(cls: type[ToolCallParser]) -> type[ToolCallParser]:
        if name in PARSERS:
            raise ValueError(f"tool-call parser {name!r} is registered twice")
        PARSERS[name] = cls
        return cls

    return add


def call_from_object(obj: Any, argument_keys: tuple[str, ...]) -> ParsedCall | None:
    """``{"name": str, <an argument key>: object}`` → a call; anything else → None. A call without
    arguments has ``{}`` (a function that takes none)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args: Any = {}
    for key in argument_keys:
        if key in obj:
            args = obj[key]
            break
    if not isinstance(args, dict):
        return None
    return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))


def held_back(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` could be the start of ``marker`` (to hold back)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def merge_text(pieces: list[Piece]) -> list[Piece]:
    """Adjacent text pieces joined, empty ones dropped (the same pieces however the text was fed)."""
    out: list[Piece] = []
    for p in pieces:
        if isinstance(p, str):
            if not p:
                continue
            if out and isinstance(out[-1], str):
                out[-1] += p
                continue
        out.append(p)
    return out
