"""``response_format`` at the edge: its shapes validated (every error names it), mapped to the
grammar the pools enforce, and compiled against the bundled model's real tokenizer before any
prefill (a schema llguidance cannot compile is a 400 naming ``response_format``; random schemas
never raise anything else)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from engine.sampling.grammar import GrammarError, GrammarSpec
from router.codec import TextCodec, load_codec
from router.config import RouterConfig
from router.errors import APIError, from_validation_errors
from router.fields import REFUSED, account
from router.prompt import sampling_for
from router.protocol import ChatCompletionRequest, CompletionRequest, GenerationRequest
from router.response_format import check_grammar, grammar_for
from tests.support.pd_fakes import FakeCodec

pytestmark = pytest.mark.timeout(120)

SCHEMA = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
MESSAGES = [{"role": "user", "content": "hi"}]


def chat(fmt: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": MESSAGES, "response_format": fmt})


@pytest.fixture(scope="module")
def codec() -> TextCodec:
    return load_codec(RouterConfig())


@pytest.mark.parametrize(("fmt", "spec"), [
    (None, None), ({"type": "text"}, None), ({"type": "json_object"}, GrammarSpec("json_object")),
    ({"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA, "strict": True}},
     GrammarSpec("json_schema", json.dumps(SCHEMA))),
    ({"type": "json_schema", "json_schema": {"name": "s", "description": "d", "schema": SCHEMA, "strict": False}},
     GrammarSpec("json_schema", json.dumps(SCHEMA)))])
def test_served_formats_map_to_their_grammar(fmt: Any, spec: GrammarSpec | None) -> None:
    assert grammar_for(chat(fmt).response_format) == spec
    comp = CompletionRequest.model_validate({"model": "m", "prompt": "p", "response_format": fmt})
    params = sampling_for(comp, 3, 100, None, (0,), False, 256)
    assert params.grammar == spec  # completions take it too, as vLLM's do


@pytest.mark.parametrize("fmt", [
    "json", {"type": "regex"}, {"type": "json_schema"}, {"type": "json_schema", "json_schema": {"schema": SCHEMA}},
    {"type": "json_schema", "json_schema": {"name": "s"}}, {"type": "json_schema", "json_schema": {"name": "s",
                                                                                                  "schema": [1]}},
    {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA, "strict": "yes"}},
    {"type": "json_object", "json_schema": {"name": "s", "schema": SCHEMA}}])
def test_unserved_shapes_are_400s_naming_response_format(fmt: Any) -> None:
    account({"response_format": fmt}, frozenset(GenerationRequest.model_fields))  # served: passes the tables
    with pytest.raises(ValidationError) as e:
        chat(fmt)
    err = from_validation_errors(e.value.errors())
    assert err.status == 400 and err.param == "response_format" and "response_format" in err.message


def test_guided_decoding_fields_point_at_response_format() -> None:
    assert "response_format" not in REFUSED
    with pytest.raises(APIError, match="response_format") as e:
        account({"guided_json": SCHEMA}, frozenset(GenerationRequest.model_fields))
    assert e.value.param == "guided_json"


@pytest.mark.parametrize("make_codec", [lambda: None, FakeCodec], ids=["bundled", "fake"])
async def test_a_schema_that_does_not_compile_is_a_400_before_prefill(codec: TextCodec, make_codec: Any) -> None:
    used = make_codec() or codec
    await check_grammar(None, used)
    await check_grammar(GrammarSpec("json_schema", json.dumps(SCHEMA)), used)
    await check_grammar(GrammarSpec("json_object"), used)
    bad = GrammarSpec("json_schema", json.dumps({"type": "object", "properties": {"x": {"type": "nope"}}}))
    with pytest.raises(APIError) as e:
        await check_grammar(bad, used)
    assert e.value.status == 400 and e.value.param == "response_format" and "nope" in e.value.message


async def test_the_codec_compiles_as_the_pools_do(codec: TextCodec) -> None:
    with pytest.raises(GrammarError, match="look-around"):
        await codec.compile_grammar(GrammarSpec("json_schema", json.dumps({"type": "string",
                                                                            "pattern": "(?<=a)b"})))


JSON_LEAVES = st.none() | st.booleans() | st.integers(-5, 5) | st.floats(allow_nan=False, width=32) | st.sampled_from(
    ["object", "string", "integer", "number", "array", "boolean", "null", "a+", "#/x", "email", ""])
SCHEMA_KEYS = st.sampled_from(["type", "properties", "items", "enum", "const", "required", "minimum", "maximum",
                               "pattern", "anyOf", "oneOf", "allOf", "$ref", "$defs", "additionalProperties",
                               "minItems", "maxItems", "format", "not", "x"])
SCHEMAS = st.dictionaries(SCHEMA_KEYS, st.recursive(
    JSON_LEAVES, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(SCHEMA_KEYS, inner, max_size=3),
    max_leaves=12), max_size=4)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=SCHEMAS)
def test_any_schema_compiles_or_is_a_400_naming_response_format(codec: TextCodec, schema: dict[str, Any]) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    spec = grammar_for(chat(fmt).response_format)
    try:
        asyncio.run(check_grammar(spec, codec))
    except APIError as e:
        assert e.status == 400 and e.param == "response_format"
