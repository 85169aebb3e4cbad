"""Chat templates that render tools, and tool calls in the history, against transformers.

Oracle: ``transformers.AutoTokenizer.apply_chat_template(messages, tools=...)`` on the same folder
(SmolLM2's tokenizer files under Qwen2.5's template and a Llama 3.1 JSON tool template), for
the messages in the form transformers documents (a call's ``arguments`` as an object).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jinja2
import pytest
import transformers

from engine.tokenizer import Tokenizer, template_variables
from tests.support.models import bundled_tokenizer_dir
from tests.support.tool_templates import LLAMA3_1_JSON, QWEN2_5, tokenizer_with_template

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city, now.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "Local time (é, ü: non-ASCII)",
                                         "parameters": {"type": "object", "properties": {}}}}
ASK = {"role": "user", "content": "What is the weather in Paris? Answer briefly."}
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}}
SECOND = {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": {}}}
CONVERSATIONS: dict[str, list[dict[str, Any]]] = {
    "ask": [ASK],
    "system": [{"role": "system", "content": "Be terse."}, ASK],
    "answered": [ASK, {"role": "assistant", "content": "", "tool_calls": [CALL]},
                 {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21}"}],
    "two calls": [ASK, {"role": "assistant", "content": "Looking.", "tool_calls": [CALL, SECOND]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
                  {"role": "tool", "tool_call_id": "call_2", "content": "12:00"}],
}
TEMPLATES = {"qwen2_5": QWEN2_5, "llama3_1_json": LLAMA3_1_JSON}


@pytest.fixture(scope="module", params=sorted(TEMPLATES))
def folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tokenizer_with_template(tmp_path_factory.mktemp(request.param), TEMPLATES[request.param])


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("tools", [[WEATHER, TIME], None], ids=["tools", "no-tools"])
def test_tools_and_calls_render_as_transformers_renders_them(folder: Path, name: str,
                                                             tools: list[dict[str, Any]] | None) -> None:
    messages = CONVERSATIONS[name]
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    ours = Tokenizer.from_dir(folder)
    if "llama" in folder.name and name == "two calls":  # the template refuses two calls in one message
        with pytest.raises(jinja2.TemplateError, match="single tool-calls"):
            hf.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
        with pytest.raises(jinja2.TemplateError, match="single tool-calls"):
            ours.apply_chat_template(messages, tools=tools)
        return
    expected = hf.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(messages, tools=tools) == expected
    assert ours.encode_chat(messages, tools=tools) == hf.encode(expected, add_special_tokens=False)
    if tools:  # the tools really are in the prompt
        assert "get_weather" in expected and "The weather in a city, now." in expected


def test_renders_tools_reads_the_template(folder: Path, tmp_path: Path) -> None:
    assert Tokenizer.from_dir(folder).renders_tools
    assert not Tokenizer.from_dir(bundled_tokenizer_dir()).renders_tools  # SmolLM2's: roles and content
    assert "tools" in template_variables(QWEN2_5) and "messages" in template_variables(QWEN2_5)
    assert "tools" not in template_variables("{% set tools = 1 %}{{ tools }}{{ messages }}")
