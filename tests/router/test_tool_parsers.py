"""Tool-call parsers (router/tool_parsers): each format's calls, the text around them, malformed calls
left as content, and the same pieces however the output is cut into streamed chunks.

Oracles: ``json.loads`` of the arguments against the objects written into the output, the output's
own text outside the calls, and for streaming the parse of the whole output at once.
"""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.tool_parsers import PARSERS, ParsedCall, Piece, merge_text, parser_for_template
from router.tool_parsers.base import ToolCallParser
from router.tool_parsers.forced import ForcedCalls
from tests.support.models import bundled_tokenizer_dir
from tests.support.tool_templates import LLAMA3_1_JSON, QWEN2_5

PARIS = {"city": "Paris", "unit": "c"}
ODD = {"q": "a } ] \" \\ { [ <tool_call> é 東京", "n": [1, {"x": None}], "ok": True}


def hermes(name: str, args: object) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": args})}\n</tool_call>'


def calls(pieces: list[Piece]) -> list[tuple[str, object]]:
    return [(p.name, json.loads(p.arguments)) for p in pieces if isinstance(p, ParsedCall)]


def text(pieces: list[Piece]) -> str:
    return "".join(p for p in pieces if isinstance(p, str))


def streamed(parser: ToolCallParser, output: str, cuts: list[int]) -> list[Piece]:
    pieces: list[Piece] = []
    bounds = [0, *sorted(set(cuts)), len(output)]
    for a, b in itertools.pairwise(bounds):
        pieces += parser.feed(output[a:b])
    return merge_text(pieces + parser.finish())


HERMES_OUTPUTS = {
    "one call": (hermes("get_weather", PARIS), [("get_weather", PARIS)], ""),
    "text around": ("Let me check.\n" + hermes("get_weather", PARIS) + "\nDone.",
                    [("get_weather", PARIS)], "Let me check.\n\nDone."),
    "two calls": (hermes("get_weather", PARIS) + "\n" + hermes("lookup", ODD),
                  [("get_weather", PARIS), ("lookup", ODD)], "\n"),
    "no arguments": ('<tool_call>{"name": "now"}</tool_call>', [("now", {})], ""),
    "malformed JSON": ('Hi <tool_call>{"name": "f", "arguments": {</tool_call>!', [],
                       'Hi <tool_call>{"name": "f", "arguments": {</tool_call>!'),
    "no name": ('<tool_call>{"arguments": {}}</tool_call>', [], '<tool_call>{"arguments": {}}</tool_call>'),
    "arguments not an object": ('<tool_call>{"name": "f", "arguments": "x"}</tool_call>', [],
                                '<tool_call>{"name": "f", "arguments": "x"}</tool_call>'),
    "unclosed at the end": ('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n', [("f", {"a": 1})], ""),
    "a marker's start at the end": ("just text <tool_c", [], "just text <tool_c"),
    "prose": ("No tools needed: 2 < 3 and <tool> is not a marker.", [],
              "No tools needed: 2 < 3 and <tool> is not a marker."),
}
LLAMA_OUTPUTS = {
    "one call": (json.dumps({"name": "get_weather", "parameters": PARIS}), [("get_weather", PARIS)], ""),
    "python tag": ("<|python_tag|>" + json.dumps({"name": "f", "parameters": ODD}), [("f", ODD)], ""),
    "two calls": (' {"name": "a", "parameters": {}}; {"name": "b", "arguments": {"x": 1}} ',
                  [("a", {}), ("b", {"x": 1})], ""),
    "prose": ("The weather is fine {\"name\": 1}", [], "The weather is fine {\"name\": 1}"),
    "malformed": ('{"name": "f", "parameters": {"a": }', [], '{"name": "f", "parameters": {"a": }'),
    "trailing prose": ('{"name": "f", "parameters": {}} and more', [], '{"name": "f", "parameters": {}} and more'),
}
FORCED_OUTPUTS = {
    "array": (True, json.dumps([{"name": "get_weather", "arguments": PARIS}, {"name": "lookup", "arguments": ODD}]),
              [("get_weather", PARIS), ("lookup", ODD)], ""),
    "one object": (False, json.dumps({"name": "lookup", "arguments": ODD}), [("lookup", ODD)], ""),
    "cut short": (True, '[{"name": "a", "arguments": {}}, {"name": "b", "argu', [("a", {})],
                  '{"name": "b", "argu'),
}


def make(kind: str, parallel: bool = True) -> ToolCallParser:
    return ForcedCalls(parallel) if kind == "forced" else PARSERS[kind]()


CASES = ([("hermes", True, *v) for v in HERMES_OUTPUTS.values()]
         + [("llama3_json", True, *v) for v in LLAMA_OUTPUTS.values()]
         + [("forced", *v) for v in FORCED_OUTPUTS.values()])
IDS = ([f"hermes-{k}" for k in HERMES_OUTPUTS] + [f"llama-{k}" for k in LLAMA_OUTPUTS]
       + [f"forced-{k}" for k in FORCED_OUTPUTS])


@pytest.mark.parametrize(("kind", "parallel", "output", "want_calls", "want_text"), CASES, ids=IDS)
def test_whole_outputs(kind: str, parallel: bool, output: str, want_calls: list[tuple[str, object]],
                       want_text: str) -> None:
    pieces = make(kind, parallel).parse(output)
    assert calls(pieces) == want_calls
    assert text(pieces) == want_text


@settings(max_examples=60, deadline=None)
@given(case=st.sampled_from(CASES), cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=12))
def test_any_split_gives_the_same_pieces(case: tuple[str, bool, str, object, str], cuts: list[int]) -> None:
    kind, parallel, output, _, _ = case
    whole = make(kind, parallel).parse(output)
    assert streamed(make(kind, parallel), output, [c for c in cuts if c < len(output)]) == whole


def test_one_character_at_a_time() -> None:
    output = "Sure.\n" + hermes("get_weather", PARIS) + hermes("lookup", ODD)
    assert streamed(PARSERS["hermes"](), output, list(range(len(output)))) == PARSERS["hermes"]().parse(output)


def test_text_streams_at_once_and_only_a_marker_prefix_is_held() -> None:
    h = PARSERS["hermes"]()
    assert h.feed("Hello <tool") == ["Hello "]
    assert merge_text(h.feed("box> ok")) == ["<toolbox> ok"]
    llama = PARSERS["llama3_json"]()
    assert llama.feed("  ") == [] and llama.feed("The") == ["  The"] and llama.feed(" end") == [" end"]
    held = PARSERS["llama3_json"]()
    assert held.feed('{"name": "f", ') == [] and held.feed('"parameters": {}}') == []
    assert calls(held.finish()) == [("f", {})]


def test_the_template_picks_the_parser() -> None:
    assert parser_for_template(QWEN2_5) == "hermes"
    assert parser_for_template(LLAMA3_1_JSON) == "llama3_json"
    smollm = json.loads((bundled_tokenizer_dir() / "tokenizer_config.json").read_text())["chat_template"]
    assert parser_for_template(smollm) is None and parser_for_template(None) is None
