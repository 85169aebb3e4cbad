"""A small JSON schema and its `GrammarSpec`, shared by the grammar tests and the device sampler's
tests: an object of an enum, a bounded integer and a boolean, no other properties."""

from __future__ import annotations

import json

from engine.sampling.grammar import GrammarSpec

SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "light blue"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
    },
    "required": ["color", "n", "ok"],
    "additionalProperties": False,
}
SPEC = GrammarSpec("json_schema", json.dumps(SCHEMA))
