"""Structured outputs at the HTTP edge: OpenAI's ``response_format`` and the grammar it asks for.

Owns: `ResponseFormat` (the request field: ``text``, ``json_object``, or ``json_schema`` with
``name``, ``schema``, optional ``description`` / ``strict``), `grammar_for` (→ the
`engine.sampling.grammar.GrammarSpec` the pools enforce; ``text``: none) and `check_grammar` (the spec
compiled by the codec against the model's tokenizer, off the event loop, before any prefill).

Invariants: any other type or shape is a validation error of the field itself (a 400 whose
``param`` is ``response_format``); a schema llguidance cannot compile is a 400 naming the field the
schema came from, and the pools compile the same spec the same way, so nothing the router let
through fails to compile there. ``strict`` is accepted either way: the schema is always enforced.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, model_validator

from engine.sampling.grammar import GrammarError, GrammarSpec
from router.errors import bad_request

if TYPE_CHECKING:
    from router.codec import TextCodec

RESPONSE_FORMATS = ("text", "json_object", "json_schema")


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: ``text`` (no constraint), ``json_object`` (any JSON object) or
    ``json_schema`` (``json_schema`` holds ``name``, ``schema``: a JSON Schema object, and optional
    ``description`` / ``strict``; the schema is enforced whether ``strict`` is true or not). Every
    error names the field itself (the app maps it to ``param: response_format``)."""

    model_config = ConfigDict(extra="ignore")
    type: str
    json_schema: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _shape(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            raise ValueError("must be an object with a 'type'")
        kind = data.get("type")
        if kind not in RESPONSE_FORMATS:
            raise ValueError(f"type {kind!r} is not supported; use one of {', '.join(RESPONSE_FORMATS)}")
        spec = data.get("json_schema")
        if kind != "json_schema":
            if spec is not None:
                raise ValueError(f"json_schema goes with type 'json_schema', not {kind!r}")
            return data
        if not isinstance(spec, dict):
            raise ValueError("type 'json_schema' needs a json_schema object")
        if not isinstance(spec.get("name"), str) or not spec["name"]:
            raise ValueError("json_schema.name is required")
        if not isinstance(spec.get("schema"), dict):
            raise ValueError("json_schema.schema is required: a JSON Schema object")
        if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
            raise ValueError("json_schema.strict must be a boolean")
        return data

    @property
    def schema_text(self) -> str | None:
        """The schema's JSON text (``json_schema``), else None."""
        return None if self.json_schema is None else json.dumps(self.json_schema["schema"])


def grammar_for(fmt: ResponseFormat | None) -> GrammarSpec | None:
    """``response_format`` → the grammar the output must match (``text``: none)."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return GrammarSpec("json_object")
    return GrammarSpec("json_schema", fmt.schema_text or "")


async def check_grammar(spec: GrammarSpec | None, codec: TextCodec, param: str = "response_format") -> None:
    """A grammar llguidance cannot compile against the model's tokenizer is a 400 naming ``param``
    (the field the schema came from), before any prefill (the pools compile the same spec the same way)."""
    if spec is None:
        return
    try:
        await codec.compile_grammar(spec)
    except GrammarError as e:
        raise bad_request(f"{param}: the schema cannot be enforced: {e}", param=param) from None
