"""Every request field accounted for (router/fields.py): served, refused with a 400 naming it, or ignored."""

from __future__ import annotations

import logging

import pytest
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params

from router.errors import APIError
from router.fields import IGNORED, REFUSED, account
from router.protocol import ChatCompletionRequest, CompletionRequest

pytestmark = pytest.mark.timeout(30)

CHAT = frozenset(ChatCompletionRequest.model_fields)
COMP = frozenset(CompletionRequest.model_fields)
VLLM_EXTENSIONS = ("top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids",
                   "skip_special_tokens", "include_stop_str_in_output")


@pytest.mark.parametrize(("served", "params"), [
    (CHAT, chat_create_params.CompletionCreateParamsBase),
    (COMP, completion_create_params.CompletionCreateParamsBase),
])
def test_every_field_of_the_official_client_is_accounted_for(served: frozenset[str], params: type) -> None:
    names = set(params.__annotations__) | {"stream"}
    missing = sorted(n for n in names if n not in served and n not in REFUSED and n not in IGNORED)
    assert not missing, missing
    for name in VLLM_EXTENSIONS:
        assert name in served or name in REFUSED, name


def test_tables_are_disjoint_and_hold_no_served_field() -> None:
    assert not set(REFUSED) & set(IGNORED)
    assert not set(IGNORED) & (CHAT | COMP) and not set(REFUSED) & CHAT & COMP
    assert set(REFUSED) & COMP == {"echo"}  # served on completions, refused on chat
    assert set(REFUSED) & CHAT == {"tools", "tool_choice", "parallel_tool_calls"}  # and the other way round


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_each_refused_field_is_a_400_naming_it(name: str) -> None:
    with pytest.raises(APIError) as e:
        account({"model": "m", name: "not-the-default"}, COMP if name in CHAT else CHAT)
    err = e.value
    assert err.status == 400 and err.param == name and name in err.message
    assert set(err.body()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize(("name", "value"), [
    ("tools", [{"type": "function", "function": {"name": "f"}}]), ("tool_choice", "required"),
    ("echo", True), ("best_of", 3), ("suffix", "x"),
    ("modalities", ["text", "audio"]), ("use_beam_search", True), ("guided_json", {"type": "object"}),
])
def test_realistic_refusals(name: str, value: object) -> None:
    with pytest.raises(APIError) as e:
        account({name: value}, CHAT if name == "echo" else COMP)
    assert e.value.param == name


@pytest.mark.parametrize(("name", "value"), [
    ("n", 1), ("n", None), ("tools", []), ("tool_choice", "none"), ("tool_choice", "auto"),
    ("echo", False), ("best_of", 1), ("suffix", ""),
    ("modalities", ["text"]), ("parallel_tool_calls", False), ("user", "u1"), ("store", True),
    ("metadata", {"k": "v"}), ("service_tier", "auto"), ("safety_identifier", "x"),
])
def test_defaults_and_metadata_pass(name: str, value: object, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="pdserve.router"):
        account({"model": "m", name: value}, CHAT)
    assert not caplog.records


def test_a_refused_default_is_not_mistaken_for_an_equal_value_of_another_type() -> None:
    with pytest.raises(APIError):
        account({"echo": 0.5}, CHAT)
    with pytest.raises(APIError):
        account({"best_of": True}, COMP)  # True == 1 in Python, not in JSON


def test_unknown_fields_are_ignored_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="pdserve.router"):
        account({"model": "m", "prompt": "x", "vendor_knob": 3, "other": None}, COMP)
    assert "vendor_knob" in caplog.text and "other" in caplog.text


def test_malformed_tool_calls_in_messages_are_400s_naming_them() -> None:
    from pydantic import ValidationError

    from router.errors import from_validation_errors

    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    for message, param in (
        ({"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function"}]},
         "messages.0.tool_calls.0.function"),
        ({"role": "user", "content": "x", "tool_calls": [call]}, "messages.0"),
        ({"role": "assistant", "tool_calls": [{**call, "function": {"name": "f", "arguments": "{x"}}]},
         "messages.0.tool_calls.0.function.arguments"),
    ):
        with pytest.raises(ValidationError) as e:
            ChatCompletionRequest.model_validate({"model": "m", "messages": [message]})
        assert from_validation_errors(e.value.errors()).param == param
