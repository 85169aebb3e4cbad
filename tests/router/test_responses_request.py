"""A Responses request: every field accounted for (served, refused with a 400 naming it, or ignored),
and the chat completions request it becomes (`router.responses.convert`), whose prompt is the one
the chat endpoint renders for the same conversation."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from openai.types.responses import response_create_params
from pydantic import ValidationError

from router.errors import APIError, from_validation_errors
from router.fields import account
from router.objectives import Objectives, SLOClass
from router.prompt import chat_prompt
from router.protocol import ChatCompletionRequest
from router.request_objective import objective_for
from router.responses.convert import to_chat
from router.responses.fields import IGNORED, REFUSED
from router.responses.request import ResponsesRequest
from router.tools import plan_tools
from tests.support.pd_fakes import FakeToolCodec

pytestmark = pytest.mark.timeout(30)

SERVED = frozenset(ResponsesRequest.model_fields)
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
           "strict": None}


ASK_HI = {"role": "user", "content": "hi"}


def req(**fields: Any) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"model": "m", "input": "hi", **fields})


def test_every_field_of_the_official_client_is_accounted_for() -> None:
    names = set(response_create_params.ResponseCreateParamsBase.__annotations__) | {"stream"}
    missing = sorted(n for n in names if n not in SERVED and n not in REFUSED and n not in IGNORED)
    assert not missing, missing


def test_tables_are_disjoint_and_hold_no_served_field() -> None:
    assert not set(REFUSED) & set(IGNORED)
    assert not (set(REFUSED) | set(IGNORED)) & SERVED


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_each_refused_field_is_a_400_naming_it(name: str) -> None:
    with pytest.raises(APIError) as e:
        account({"model": "m", "input": "x", name: "not-the-default"}, SERVED, REFUSED, IGNORED)
    assert e.value.status == 400 and e.value.param == name and name in e.value.message


@pytest.mark.parametrize(("name", "value"), [
    ("previous_response_id", "resp_1"), ("background", True), ("reasoning", {"effort": "high"}),
    ("include", ["message.output_text.logprobs"]), ("truncation", "auto"), ("top_logprobs", 3),
    ("conversation", "conv_1"), ("max_tokens", 5),
])
def test_realistic_refusals(name: str, value: object) -> None:
    with pytest.raises(APIError) as e:
        account({"model": "m", "input": "x", name: value}, SERVED, REFUSED, IGNORED)
    assert e.value.param == name


@pytest.mark.parametrize(("name", "value"), [
    ("background", False), ("include", []), ("truncation", "disabled"), ("top_logprobs", 0),
    ("reasoning", None), ("service_tier", "auto"), ("safety_identifier", "s"), ("prompt_cache_key", "k"),
])
def test_defaults_and_metadata_pass(name: str, value: object) -> None:
    account({"model": "m", "input": "x", name: value}, SERVED, REFUSED, IGNORED)  # raises on a refusal


def test_the_conversation_becomes_chat_messages() -> None:
    items = [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking.",
                                                              "annotations": []}], "id": "msg_1",
         "status": "completed"},
        {"type": "function_call", "call_id": "call_7", "name": "get_weather", "arguments": '{"city": "Paris"}',
         "id": "fc_1", "status": "completed"},
        {"type": "function_call_output", "call_id": "call_7", "output": "21 C"},
        {"role": "developer", "content": [{"type": "input_text", "text": "Be "}, {"type": "input_text",
                                                                                   "text": "brief."}]},
    ]
    chat = to_chat(req(input=items, instructions="You are terse."))
    got = [m.to_template() for m in chat.messages]
    assert got == [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "call_7", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "21 C", "tool_call_id": "call_7"},
        {"role": "system", "content": "Be brief."},
    ]


def test_settings_tools_and_format_map_to_their_chat_fields() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    chat = to_chat(req(max_output_tokens=9, temperature=0.0, top_p=0.5, stream=True, tools=[WEATHER],
                       tool_choice={"type": "function", "name": "get_weather"}, parallel_tool_calls=False,
                       text={"format": {"type": "json_schema", "name": "s", "schema": schema, "strict": True}}))
    assert (chat.max_completion_tokens, chat.temperature, chat.top_p, chat.stream) == (9, 0.0, 0.5, True)
    assert chat.tools is not None and chat.tools[0].function is not None
    assert chat.tools[0].function.name == "get_weather" and chat.tools[0].function.parameters == WEATHER["parameters"]
    assert not isinstance(chat.tool_choice, str) and chat.tool_choice is not None
    assert chat.tool_choice.function.name == "get_weather" and chat.parallel_tool_calls is False
    assert chat.response_format is not None and chat.response_format.json_schema == {
        "name": "s", "schema": schema, "strict": True}
    bare = to_chat(req())  # what was not sent stays unset: the model's generation config fills it
    assert {"temperature", "top_p", "max_completion_tokens"}.isdisjoint(bare.model_fields_set)


def test_the_prompt_is_the_one_chat_renders_for_the_same_conversation() -> None:
    codec = FakeToolCodec()
    chat_body = {"model": "m", "tools": [{"type": "function", "function": {
        k: v for k, v in WEATHER.items() if k not in ("type", "strict")}}],
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"}]}
    oracle = ChatCompletionRequest.model_validate(chat_body)
    ours = to_chat(req(instructions="Be brief.", input="Weather?", tools=[WEATHER]))
    assert chat_prompt(ours, codec, plan_tools(ours, codec).template_tools) == \
        chat_prompt(oracle, codec, plan_tools(oracle, codec).template_tools)


@pytest.mark.parametrize(("fields", "param"), [
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, "tools"),
    ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
    ({"text": {"format": {"type": "json_schema", "name": "s"}}}, "text"),
    ({"text": {"format": {"type": "grammar"}}}, "text"),
])
def test_what_the_chat_path_cannot_serve_is_a_400_naming_the_responses_field(fields: dict[str, Any],
                                                                            param: str) -> None:
    with pytest.raises(APIError) as e:
        to_chat(req(**fields))
    assert e.value.status == 400 and e.value.param == param


@pytest.mark.parametrize("fields", [
    {"input": ""}, {"input": []},
    {"input": [{"type": "reasoning", "summary": []}]},
    {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
    {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{not json"}]},
    {"text": {"verbosity": "high"}},
])
def test_unserved_input_is_a_validation_error_naming_its_field(fields: dict[str, Any]) -> None:
    with pytest.raises(ValidationError) as e:
        req(**fields)
    err = from_validation_errors(e.value.errors())
    assert err.status == 400 and err.param is not None and err.param.split(".")[0] == next(iter(fields))


def test_slo_class_is_served_and_reaches_the_chat_request(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="pdserve.router"):
        account({"model": "m", "input": "x", "slo_class": "batch"}, SERVED, REFUSED, IGNORED)  # not refused
    assert "slo_class" not in caplog.text  # nor dropped as unknown
    assert to_chat(req(slo_class="batch")).slo_class == "batch"
    assert to_chat(req()).slo_class is None and "slo_class" not in to_chat(req()).model_fields_set


@pytest.mark.parametrize(("objectives", "name"), [(Objectives((SLOClass("chat", ttft_s=0.5, tpot_s=0.1),)), "gold"),
                                                  (Objectives(), "chat")])
def test_a_class_not_configured_is_the_chat_paths_400_naming_slo_class(objectives: Objectives, name: str) -> None:
    chat = to_chat(req(slo_class=name))
    with pytest.raises(APIError) as ours:
        objective_for(objectives, 3, chat.slo_class, 0.0)
    with pytest.raises(APIError) as oracle:  # the chat endpoint's answer to the same class
        objective_for(objectives, 3, ChatCompletionRequest.model_validate(
            {"model": "m", "messages": [ASK_HI], "slo_class": name}).slo_class, 0.0)
    assert ours.value.status == 400 and ours.value.param == "slo_class" and name in ours.value.message
    assert (ours.value.status, ours.value.param, ours.value.message) == \
        (oracle.value.status, oracle.value.param, oracle.value.message)
