"""The Responses API (``POST /v1/responses``) through a real local Ray Serve, with the official
``openai`` client, on the same generation path as chat completions.

Three apps on the package's Ray cluster (tests/e2e/conftest.py), from `tests.support.tool_apps`:

- ``/tiny-pd`` and ``/tiny-colo``: a tiny random Llama with SmolLM2's tokenizer under Qwen2.5's chat
  template (which renders tools and tool messages), real prefill / decode replicas. Oracle: the
  chat completions answer to the same conversation (greedy, so both must be the same text, from the
  same prompt: usage's input tokens equal chat's prompt tokens).
- ``/fake``: the real router over the deterministic fake pools (`tests.support.pd_fakes`) with a
  tokenizer whose template renders tools; scripted answers (``SAY[[...]]``) make a tool call known in
  advance, ``SLOW`` makes a stream long enough to leave.

The streamed oracle is the client's own accumulator (``responses.stream(...).get_final_response()``),
which must equal the non-streamed response but for the ids and the creation time.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, Field
from ray import serve

from tests.support.tool_apps import tiny_tool_model, tool_apps

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

#: a function whose only argument is an enum: a forced call of it is short, whatever the random model
CITY: Any = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
        "additionalProperties": False}
WEATHER: Any = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": CITY, "strict": None}
CHAT_WEATHER: Any = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                                 "parameters": CITY}}
ASK: Any = {"role": "user", "content": "Weather in Paris?"}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


class Person(BaseModel):
    name: Literal["ann", "bob"]
    age: int = Field(ge=0, le=120)
    tags: list[Literal["x", "y"]] = Field(max_length=3)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_tool_model(tmp_path_factory.mktemp("qwen-tiny"))


@pytest.fixture(scope="module")
def apps(serve_base: str, tiny: Path) -> Iterator[dict[str, str]]:
    with tool_apps(serve_base, tiny) as urls:
        yield urls


def client(apps: dict[str, str], name: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{apps[name]}/v1", api_key="unused", timeout=120, max_retries=0)


def comparable(response: Any) -> dict[str, Any]:
    """A response without what differs between two calls (ids, creation time), nor what the stream
    accumulator adds to what it read (``parsed``: it parses as ``responses.parse`` does)."""
    out = response.model_dump(exclude={"id", "created_at", "output_parsed"})
    for item in out["output"]:
        for key in ("id", "call_id", "parsed_arguments"):
            item.pop(key, None)
        for part in item.get("content", []):
            part.pop("parsed", None)
    return out


# ------------------------------------------------------------------------ the real model, both modes


@pytest.mark.parametrize("app", ["tiny-pd", "tiny-colo"])
def test_greedy_text_is_chat_completions_answer_streamed_or_whole(apps: dict[str, str], app: str) -> None:
    c = client(apps, app)
    chat = c.chat.completions.create(model="tiny", temperature=0, max_tokens=16, messages=[
        {"role": "system", "content": "Be brief."}, ASK])
    got = c.responses.create(model="tiny", instructions="Be brief.", input="Weather in Paris?", temperature=0,
                             max_output_tokens=16)
    assert got.output_text == chat.choices[0].message.content
    assert got.usage is not None and chat.usage is not None
    assert (got.usage.input_tokens, got.usage.output_tokens) == (chat.usage.prompt_tokens,
                                                                  chat.usage.completion_tokens)
    assert got.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    with c.responses.stream(model="tiny", instructions="Be brief.", input="Weather in Paris?", temperature=0,
                            max_output_tokens=16) as stream:
        events = list(stream)  # through the client's accumulator, which checks each event against the last
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    last = events[-1]
    assert last.type == ("response.completed" if got.status == "completed" else "response.incomplete")
    assert comparable(last.response) == comparable(got)  # type: ignore[union-attr]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == got.output_text


def test_max_output_tokens_gives_incomplete(apps: dict[str, str]) -> None:
    c = client(apps, "tiny-colo")
    got = c.responses.create(model="tiny", input="Tell me a long story.", temperature=0, max_output_tokens=2)
    chat = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Tell me a long story."}],
                                     temperature=0, max_tokens=2).choices[0]
    assert chat.finish_reason == "length"  # the model did not stop by itself within 2 tokens
    assert got.status == "incomplete" and got.incomplete_details is not None
    assert got.incomplete_details.reason == "max_output_tokens"
    assert got.usage is not None and got.usage.output_tokens == 2 and got.output_text == chat.message.content


def test_parse_with_a_pydantic_model_validates(apps: dict[str, str]) -> None:
    got = client(apps, "tiny-pd").responses.parse(model="tiny", input="Describe a person as JSON.",
                                                  text_format=Person, temperature=0, max_output_tokens=60)
    assert got.status == "completed"
    assert isinstance(got.output_parsed, Person)
    assert Person.model_validate_json(got.output_text) == got.output_parsed


def test_a_function_call_round_trip_answers_as_chat_does(apps: dict[str, str]) -> None:
    c = client(apps, "tiny-pd")
    first = c.responses.create(model="tiny", input=[ASK], tools=[WEATHER],
                               tool_choice={"type": "function", "name": "get_weather"}, temperature=0,
                               max_output_tokens=40)
    assert first.status == "completed" and [i.type for i in first.output] == ["function_call"]
    call = first.output[0]
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    city = json.loads(call.arguments)["city"]
    assert city in ("Paris", "Rome")
    answer = c.responses.create(
        model="tiny", tools=[WEATHER], tool_choice="none", temperature=0, max_output_tokens=12,
        input=[ASK, *first.output, {"type": "function_call_output", "call_id": call.call_id, "output": "21 C"}])
    wire_call = {"id": call.call_id, "type": "function",
                 "function": {"name": "get_weather", "arguments": call.arguments}}
    chat = c.chat.completions.create(
        model="tiny", tools=[CHAT_WEATHER], tool_choice="none", temperature=0, max_tokens=12,
        messages=[ASK, {"role": "assistant", "content": None, "tool_calls": [wire_call]},
                  {"role": "tool", "tool_call_id": call.call_id, "content": "21 C"}])
    assert answer.output_text == chat.choices[0].message.content
    assert answer.usage is not None and chat.usage is not None
    assert answer.usage.input_tokens == chat.usage.prompt_tokens


# ------------------------------------------------------------------------------- scripted answers


def test_a_parsed_call_streamed_and_whole(apps: dict[str, str]) -> None:
    c = client(apps, "fake")
    ask = [{"role": "user", "content": f"SAY[[Checking. {CALL}]]"}]
    whole = c.responses.create(model="tiny", input=ask, tools=[WEATHER], max_output_tokens=400)
    assert [i.type for i in whole.output] == ["message", "function_call"] and whole.output_text == "Checking."
    assert whole.output[1].type == "function_call" and json.loads(whole.output[1].arguments) == {"city": "Paris"}
    with c.responses.stream(model="tiny", input=ask, tools=[WEATHER], max_output_tokens=400) as stream:
        streamed = stream.get_final_response()
    assert comparable(streamed) == comparable(whole)


@pytest.mark.parametrize(("fields", "param"), [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"background": True}, "background"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input"),
])
def test_refused_fields_are_400s_naming_them(apps: dict[str, str], fields: dict[str, Any], param: str) -> None:
    body: dict[str, Any] = {"model": "tiny", "input": "hi", **fields}
    with pytest.raises(openai.BadRequestError) as e:
        client(apps, "fake").responses.create(**body)
    assert isinstance(e.value.body, dict) and e.value.body["param"].split(".")[0] == param


def test_an_slo_class_reaches_the_chat_path_and_one_not_configured_is_a_400(apps: dict[str, str]) -> None:
    """pdserve's ``slo_class`` is carried to the chat path, not dropped: the app has no objectives, so
    any class is refused there, naming the field and the class."""
    with pytest.raises(openai.BadRequestError) as e:
        client(apps, "fake").responses.create(model="tiny", input="SAY[[ok]]", extra_body={"slo_class": "gold"})
    assert isinstance(e.value.body, dict) and e.value.body["param"] == "slo_class"
    assert "gold" in e.value.body["message"]


def test_responses_are_not_stored(apps: dict[str, str]) -> None:
    c = client(apps, "fake")
    got = c.responses.create(model="tiny", input="SAY[[ok]]", store=True)
    with pytest.raises(openai.NotFoundError) as e:
        c.responses.retrieve(got.id)
    assert isinstance(e.value.body, dict) and "not stored" in e.value.body["message"]


def test_leaving_mid_stream_cancels_the_decode_stream(apps: dict[str, str]) -> None:
    body = {"model": "tiny", "input": "SLOWxyz", "max_output_tokens": 150, "stream": True}
    with httpx.stream("POST", f"{apps['fake']}/v1/responses", json=body, timeout=30) as r:
        data = (json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: "))
        created = next(data)
        for _ in range(6):  # token 0 came from the prefill: read until the decode stream is running
            next(data)
    decode = serve.get_deployment_handle("decode", app_name="fake")
    deadline = time.time() + 15
    while created["response"]["id"] not in decode.cancelled.remote().result():
        assert time.time() < deadline, "decode stream was not cancelled"
        time.sleep(0.2)
