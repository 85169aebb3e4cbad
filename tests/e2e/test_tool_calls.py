"""Tool calling through a real local Ray Serve, with the official ``openai`` client.

Three apps on the package's Ray cluster (tests/e2e/conftest.py), from `tests.support.tool_apps`:

- ``/tiny-pd`` and ``/tiny-colo``: a tiny random Llama with SmolLM2's tokenizer under Qwen2.5's chat
  template (which renders tools and tool messages), real prefill / decode replicas. Oracles:
  transformers' ``apply_chat_template`` for the prompt (usage counts its tokens) and the reference
  `generate()` on that prompt for the greedy text.
- ``/fake``: the real router over the deterministic fake pools (`tests.support.pd_fakes`) with a
  tokenizer whose template renders tools; the fakes answer with a scripted text (``SAY[[...]]``),
  so a tool call in the answer is known in advance. Oracle: the calls written into the script, and
  the client's own accumulation of the streamed chunks, which must equal the non-streamed response.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import transformers

from engine.config import EngineConfig
from engine.engine import Engine
from engine.generate import generate
from engine.sampling.sampler import SamplingParams
from engine.tokenizer import Tokenizer
from tests.support.tool_apps import tiny_tool_model, tool_apps

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
ASK = {"role": "user", "content": "Weather in Paris?"}
WIRE_CALL = {"id": "call_7", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}
HISTORY = [ASK, {"role": "assistant", "content": None, "tool_calls": [WIRE_CALL]},
           {"role": "tool", "tool_call_id": "call_7", "content": "21 C, sunny"}]
#: the same history in the form transformers documents (a call's arguments as an object)
HF_HISTORY = [ASK, {"role": "assistant", "content": "",
                    "tool_calls": [{**WIRE_CALL, "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
              HISTORY[2]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_tool_model(tmp_path_factory.mktemp("qwen-tiny"))


@pytest.fixture(scope="module")
def apps(serve_base: str, tiny: Path) -> Iterator[dict[str, str]]:
    with tool_apps(serve_base, tiny) as urls:
        yield urls


def client(apps: dict[str, str], name: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{apps[name]}/v1", api_key="unused", timeout=120, max_retries=0)


# ------------------------------------------------------------------------ the real template and model


@pytest.mark.parametrize("app", ["tiny-pd", "tiny-colo"])
def test_tools_and_tool_messages_reach_the_model_as_transformers_renders_them(
        apps: dict[str, str], tiny: Path, app: str) -> None:
    hf = transformers.AutoTokenizer.from_pretrained(tiny)
    prompt = hf.encode(hf.apply_chat_template(HF_HISTORY, tools=[WEATHER, CLOCK], tokenize=False,
                                              add_generation_prompt=True), add_special_tokens=False)
    eng = Engine.from_dir(tiny, EngineConfig(num_blocks=64, block_size=16, dtype="float32"))
    tok = Tokenizer.from_dir(tiny)
    out = generate(eng, prompt, SamplingParams(max_tokens=12), eos_token_ids=tok.eos_token_ids)
    got = client(apps, app).chat.completions.create(
        model="tiny", messages=HISTORY, tools=[WEATHER, CLOCK], tool_choice="none",  # type: ignore[arg-type]
        max_tokens=12, temperature=0)
    assert got.usage is not None and got.usage.prompt_tokens == len(prompt)
    assert got.choices[0].message.content == tok.decode(out.token_ids)
    assert got.choices[0].message.tool_calls is None


@pytest.mark.parametrize("app", ["tiny-pd", "tiny-colo"])
def test_auto_answers_are_content_or_calls_never_both_lost(apps: dict[str, str], app: str) -> None:
    got = client(apps, app).chat.completions.create(
        model="tiny", messages=HISTORY, tools=[WEATHER, CLOCK], max_tokens=16, temperature=0)  # type: ignore[arg-type]
    choice = got.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert (choice.finish_reason == "tool_calls") == bool(choice.message.tool_calls)
    assert choice.message.content is not None or choice.message.tool_calls


# ------------------------------------------------------------------------------- scripted answers


def ask(script: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": f"SAY[[{script}]]"}]


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TWO = CALL + '\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'


def calls(message: Any) -> list[tuple[str, Any]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def test_auto_parses_calls_streamed_and_whole(apps: dict[str, str]) -> None:
    c = client(apps, "fake")
    whole = c.chat.completions.create(model="tiny", messages=ask("Checking. " + TWO),  # type: ignore[arg-type]
                                      tools=[WEATHER, CLOCK], max_tokens=400)  # type: ignore[arg-type]
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    assert calls(choice.message) == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert all(t.id.startswith("call_") and t.type == "function" for t in choice.message.tool_calls or [])
    with c.chat.completions.stream(model="tiny", messages=ask("Checking. " + TWO),  # type: ignore[arg-type]
                                   tools=[WEATHER, CLOCK], max_tokens=400) as stream:  # type: ignore[arg-type]
        streamed = stream.get_final_completion().choices[0]
    assert streamed.finish_reason == "tool_calls" and streamed.message.content == "Checking."
    assert calls(streamed.message) == calls(choice.message)


def test_malformed_calls_and_tool_choice_none_leave_the_text_as_content(apps: dict[str, str]) -> None:
    c = client(apps, "fake")
    bad = 'Hm <tool_call>{"name": "get_weather", "arguments": {</tool_call>'
    got = c.chat.completions.create(model="tiny", messages=ask(bad), tools=[WEATHER],  # type: ignore[arg-type]
                                    max_tokens=400).choices[0]
    assert (got.finish_reason, got.message.content, got.message.tool_calls) == ("stop", bad, None)
    none = c.chat.completions.create(model="tiny", messages=ask(CALL), tools=[WEATHER],  # type: ignore[arg-type]
                                     tool_choice="none", max_tokens=400).choices[0]
    assert (none.finish_reason, none.message.content, none.message.tool_calls) == ("stop", CALL, None)


def test_without_parallel_calls_the_first_is_kept(apps: dict[str, str]) -> None:
    got = client(apps, "fake").chat.completions.create(
        model="tiny", messages=ask(TWO), tools=[WEATHER, CLOCK], parallel_tool_calls=False,  # type: ignore[arg-type]
        max_tokens=400).choices[0]
    assert calls(got.message) == [("get_weather", {"city": "Paris"})] and got.finish_reason == "tool_calls"


def test_forced_calls_come_back_as_tool_calls(apps: dict[str, str]) -> None:
    """The fakes ignore the grammar: the script stands for the output it would constrain."""
    c = client(apps, "fake")
    named: Any = {"type": "function", "function": {"name": "get_weather"}}
    one = c.chat.completions.create(model="tiny", messages=ask('{"city": "Paris"}'),  # type: ignore[arg-type]
                                    tools=[WEATHER, CLOCK], tool_choice=named, max_tokens=400).choices[0]  # type: ignore[list-item]
    assert (one.finish_reason, one.message.content) == ("stop", None)  # OpenAI's reason for a named call
    assert calls(one.message) == [("get_weather", {"city": "Paris"})]
    with c.chat.completions.stream(model="tiny", messages=ask('{"city": "Paris"}'),  # type: ignore[arg-type]
                                   tools=[WEATHER, CLOCK], tool_choice=named, max_tokens=400) as stream:  # type: ignore[list-item]
        assert calls(stream.get_final_completion().choices[0].message) == calls(one.message)
    both = [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]
    many = c.chat.completions.create(model="tiny", messages=ask(json.dumps(both)),  # type: ignore[arg-type]
                                     tools=[WEATHER, CLOCK], tool_choice="required", max_tokens=400).choices[0]  # type: ignore[list-item]
    assert many.finish_reason == "tool_calls" and calls(many.message) == [(b["name"], b["arguments"]) for b in both]


@pytest.mark.parametrize(("fields", "param"), [
    ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
      "tool_choice": "required"}, "tools"),
])
def test_bad_tool_requests_are_400s_naming_the_field(apps: dict[str, str], fields: dict[str, Any],
                                                     param: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client(apps, "fake").chat.completions.create(model="tiny", messages=ask("x"), **fields)
    assert e.value.status_code == 400 and isinstance(e.value.body, dict) and e.value.body["param"] == param
