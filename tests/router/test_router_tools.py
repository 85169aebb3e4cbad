"""Tool calling in the router without a server: the request checked against the model's template
(router/tools.py), the OpenAI-shaped history rendered as transformers renders it, and an answer turned
into ``tool_calls`` (router/tool_stream.py through the chat formatter), streamed and whole.

Oracles: transformers' ``apply_chat_template`` for the prompt; for the stream, the official
``openai`` client's own accumulation of our chunks (``ChatCompletionStreamState``), which must give
the non-streamed response; ``json.loads`` of every call's arguments.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import transformers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk
from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer

from engine.sampling.grammar import GrammarSpec
from router.codec import EngineTextCodec
from router.errors import APIError
from router.generation import Delta
from router.openai_format import ChatFormatter
from router.prompt import chat_prompt
from router.protocol import ChatCompletionRequest
from router.tokenize import TokenizeChatRequest, tokenize
from router.tool_parsers import PARSERS
from router.tool_stream import ToolCallStream
from router.tools import NO_PARAMETERS, ToolPlan, plan_tools, required_schema, tool_grammar
from tests.support.models import bundled_tokenizer_dir, make_tiny_chat_model
from tests.support.pd_fakes import FakeCodec
from tests.support.tool_templates import LLAMA3_1_JSON, QWEN2_5, set_chat_template

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CLOCK = {"function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}, "type": "function"}
USER = {"role": "user", "content": "Weather in Paris?"}


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> EngineTextCodec:
    return EngineTextCodec(set_chat_template(make_tiny_chat_model(tmp_path_factory.mktemp("qwen")), QWEN2_5))


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> EngineTextCodec:
    return EngineTextCodec(set_chat_template(make_tiny_chat_model(tmp_path_factory.mktemp("llama")),
                                             LLAMA3_1_JSON))


@pytest.fixture(scope="module")
def smollm() -> EngineTextCodec:
    return EngineTextCodec(bundled_tokenizer_dir())


def chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": [USER], **fields})


# ------------------------------------------------------------------------------------------ the plan


def test_modes(qwen: EngineTextCodec, llama: EngineTextCodec, smollm: EngineTextCodec) -> None:
    assert plan_tools(chat(), qwen) == ToolPlan("none")
    assert plan_tools(chat(tools=[WEATHER]), qwen) == ToolPlan("auto", (WEATHER,), parser="hermes")
    assert plan_tools(chat(tools=[WEATHER], parallel_tool_calls=False), llama) == \
        ToolPlan("auto", (WEATHER,), parser="llama3_json", parallel=False)
    assert plan_tools(chat(tools=[WEATHER], tool_choice="none"), qwen) == ToolPlan("none", (WEATHER,))
    assert plan_tools(chat(tools=[WEATHER], tool_choice="none"), smollm) == ToolPlan("none")  # nothing to render
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert plan_tools(chat(tools=[WEATHER, CLOCK], tool_choice=named), smollm) == ToolPlan(
        "named", function="get_weather", parallel=False, schema=json.dumps(WEATHER["function"]["parameters"]))
    params = {"get_weather": WEATHER["function"]["parameters"], "get_time": CLOCK["function"]["parameters"]}
    assert plan_tools(chat(tools=[WEATHER, CLOCK], tool_choice="required"), qwen) == ToolPlan(
        "required", (WEATHER, CLOCK), schema=json.dumps(required_schema(params, parallel=True)))
    no_params = {"type": "function", "function": {"name": "ping"}}
    assert plan_tools(chat(tools=[no_params], tool_choice={"type": "function", "function": {"name": "ping"}}),
                      smollm).schema == json.dumps(NO_PARAMETERS)


async def test_a_forced_call_is_the_requests_grammar(smollm: EngineTextCodec) -> None:
    named = chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert await tool_grammar(plan_tools(named, smollm), named, smollm) == \
        GrammarSpec("json_schema", json.dumps(WEATHER["function"]["parameters"]))
    assert await tool_grammar(plan_tools(chat(tools=[WEATHER], tool_choice="none"), smollm), named, smollm) is None
    both = chat(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"})
    with pytest.raises(APIError) as e:
        await tool_grammar(plan_tools(both, smollm), both, smollm)
    assert e.value.param == "tool_choice" and "response_format" in e.value.message
    odd = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "nope"}}}}}
    bad = chat(tools=[odd], tool_choice="required")
    with pytest.raises(APIError) as e:
        await tool_grammar(plan_tools(bad, smollm), bad, smollm)
    assert e.value.status == 400 and e.value.param == "tools" and "nope" in e.value.message


@pytest.mark.parametrize(("fields", "param", "words"), [
    ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools", "only 'function' tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "used twice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "'nope', which is not among the tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "custom", "function": {"name": "get_weather"}}},
     "tool_choice", "type 'custom'"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [{"type": "function", "function": {**WEATHER["function"], "strict": True}}]}, "tools", "strict"),
])
def test_refusals_name_the_field(qwen: EngineTextCodec, fields: dict[str, Any], param: str, words: str) -> None:
    with pytest.raises(APIError) as e:
        plan_tools(chat(**fields), qwen)
    assert e.value.status == 400 and e.value.param == param and words in e.value.message


def test_markers_that_are_special_tokens_are_decoded(tmp_path: Path) -> None:
    """A tokenizer that makes ``<tool_call>`` a special token would hide it from the parser; ``auto``
    then decodes special tokens, and the call comes through."""
    folder = set_chat_template(make_tiny_chat_model(tmp_path / "special"), QWEN2_5)
    tok = HFTokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_special_tokens([AddedToken("<tool_call>", special=True), AddedToken("</tool_call>", special=True)])
    tok.save(str(folder / "tokenizer.json"))
    codec = EngineTextCodec(folder)
    assert codec.is_special_token("<tool_call>") and not codec.is_special_token("tool")
    assert plan_tools(chat(tools=[WEATHER]), codec).keep_special_tokens
    ids = codec.encode(CALL)
    texts = {}
    for skip in (True, False):
        detok = codec.detokenizer(skip_special_tokens=skip)
        texts[skip] = "".join(detok.push(t) for t in ids) + detok.flush()
    assert "<tool_call>" not in texts[True] and texts[False] == CALL
    assert [p.name for p in PARSERS["hermes"]().parse(texts[False]) if not isinstance(p, str)] == ["get_weather"]


def test_a_template_without_tools_refuses_auto_and_earlier_calls(smollm: EngineTextCodec) -> None:
    with pytest.raises(APIError) as e:
        plan_tools(chat(tools=[WEATHER]), smollm)
    assert e.value.param == "tools" and "does not render tools" in e.value.message
    history = [USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]}]
    with pytest.raises(APIError) as e:
        plan_tools(ChatCompletionRequest.model_validate({"model": "m", "messages": history}), smollm)
    assert e.value.param == "messages" and "messages[1]" in e.value.message
    tool_answer = [USER, {"role": "tool", "tool_call_id": "c1", "content": "21 C"}]
    assert plan_tools(ChatCompletionRequest.model_validate({"model": "m", "messages": tool_answer}),
                      smollm) == ToolPlan("none")  # a tool message is a role its template renders


def test_tokenize_counts_the_history_as_a_chat_completion_would(qwen: EngineTextCodec,
                                                                 smollm: EngineTextCodec) -> None:
    history = [USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "21 C"}]
    body = TokenizeChatRequest.model_validate({"messages": history})
    assert tokenize(body, qwen, 4096).tokens == list(chat_prompt(chat(messages=history), qwen))
    with pytest.raises(APIError) as e:
        tokenize(body, smollm, 4096)
    assert e.value.param == "messages"


def test_required_schema_is_one_call_of_any_tool_or_a_list() -> None:
    params = {"get_weather": WEATHER["function"]["parameters"], "get_time": {"type": "object"}}
    one = required_schema(params, parallel=False)
    assert [b["properties"]["name"] for b in one["anyOf"]] == [{"const": "get_weather"}, {"const": "get_time"}]
    assert one["anyOf"][0]["properties"]["arguments"] == WEATHER["function"]["parameters"]
    assert required_schema(params, parallel=True) == {"type": "array", "items": one, "minItems": 1}


SCHEMAS = [None, {}, {"type": "object"}, WEATHER["function"]["parameters"], {"type": "nope"}, {"type": "string"},
           {"type": "object", "properties": {"n": {"type": "integer", "minimum": 5, "maximum": 1}}},
           {"type": "string", "pattern": "(?<=a)b"}, {"$ref": "#/$defs/missing"}]
TOOL = st.fixed_dictionaries({"type": st.sampled_from(["function", "custom"]), "function": st.fixed_dictionaries(
    {"name": st.sampled_from(["a", "b", "get_weather"])},
    optional={"parameters": st.sampled_from(SCHEMAS), "strict": st.booleans()})})
CHOICE = st.one_of(st.sampled_from(["none", "auto", "required"]), st.builds(
    lambda kind, name: {"type": kind, "function": {"name": name}}, st.sampled_from(["function", "custom"]),
    st.sampled_from(["a", "b", "zz"])))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tools=st.lists(TOOL, max_size=3), choice=st.one_of(st.none(), CHOICE), parallel=st.booleans(),
       which=st.sampled_from(["qwen", "smollm"]), json_format=st.booleans())
async def test_any_combination_is_a_plan_or_a_400_naming_a_tool_field(
        request: pytest.FixtureRequest, tools: list[dict[str, Any]], choice: Any, parallel: bool, which: str,
        json_format: bool) -> None:
    codec: EngineTextCodec = request.getfixturevalue(which)
    fields: dict[str, Any] = {"tools": tools, "parallel_tool_calls": parallel}
    if choice is not None:
        fields["tool_choice"] = choice
    if json_format:
        fields["response_format"] = {"type": "json_object"}
    req = chat(**fields)
    try:
        plan = plan_tools(req, codec)
        grammar = await tool_grammar(plan, req, codec)
    except APIError as e:
        assert e.status == 400 and e.param in ("tools", "tool_choice"), e.message
        return
    assert (grammar is not None) == (plan.mode in ("required", "named"))
    if plan.reads_calls:
        ToolCallStream(plan).push('{"a": 1}', final=True)


# ------------------------------------------------------------------------------ the prompt, as HF's


@pytest.mark.parametrize("which", ["qwen", "llama"])
def test_openai_history_renders_as_transformers_renders_its_documented_form(
        which: str, request: pytest.FixtureRequest) -> None:
    codec: EngineTextCodec = request.getfixturevalue(which)
    wire_call = {"id": "call_9", "type": "function",
                 "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}
    req = chat(tools=[WEATHER, CLOCK], messages=[
        {"role": "system", "content": "Be terse."}, USER,
        {"role": "assistant", "content": None, "tool_calls": [wire_call]},
        {"role": "tool", "tool_call_id": "call_9", "content": "21 C"}])
    hf_messages = [{"role": "system", "content": "Be terse."}, USER,
                   {"role": "assistant", "content": "",
                    "tool_calls": [{**wire_call, "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                   {"role": "tool", "tool_call_id": "call_9", "content": "21 C"}]
    folder = Path(codec._tok._source)
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    expected = hf.apply_chat_template(hf_messages, tools=[WEATHER, CLOCK], tokenize=False, add_generation_prompt=True)
    plan = plan_tools(req, codec)
    assert list(chat_prompt(req, codec, plan.template_tools)) == hf.encode(expected, add_special_tokens=False)


# ------------------------------------------------------------------------------ the answer, as calls


def run(plan: ToolPlan, pieces: list[str], finish: str = "stop") -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The chunks of an answer cut into ``pieces`` and the non-streamed response of the same answer."""
    fmt = ChatFormatter(model="m", codec=FakeCodec(), prompt_tokens=3, logprobs=False, tools=ToolCallStream(plan))
    chunks = [fmt.chunk(Delta(p, (65,), (None,), finish if i == len(pieces) - 1 else None)).model_dump()
              for i, p in enumerate(pieces)]
    return chunks, fmt.response().model_dump()


def accumulated(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """What the official client builds from the chunks."""
    state: ChatCompletionStreamState[Any] = ChatCompletionStreamState()
    for c in chunks:
        list(state.handle_chunk(ChatCompletionChunk.model_validate(c)))
    return state.current_completion_snapshot.model_dump(exclude_unset=True)


def same_answer(chunks: list[dict[str, Any]], response: dict[str, Any]) -> dict[str, Any]:
    streamed = accumulated(chunks)["choices"][0]
    whole = response["choices"][0]
    assert streamed["finish_reason"] == whole["finish_reason"]
    assert (streamed["message"].get("content") or None) == (whole["message"]["content"] or None)
    assert calls_of(streamed["message"]) == calls_of(whole["message"])
    return whole


def calls_of(message: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    return [(c["id"], c["type"], c["function"]["name"], c["function"]["arguments"])
            for c in message.get("tool_calls") or []]


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TWO = CALL + '\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'


def cut(text: str, n: int) -> list[str]:
    return [text[i:i + n] for i in range(0, len(text), n)]


@pytest.mark.parametrize("n", [1, 3, 1000])
def test_auto_calls_streamed_and_whole(n: int) -> None:
    plan = ToolPlan("auto", parser="hermes")
    whole = same_answer(*run(plan, cut("Checking.\n" + TWO + "\n", n)))
    assert whole["finish_reason"] == "tool_calls" and whole["message"]["content"] == "Checking."
    got = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole["message"]["tool_calls"]]
    assert got == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    ids = [c["id"] for c in whole["message"]["tool_calls"]]
    assert len(set(ids)) == 2 and all(i.startswith("call_") for i in ids)


def test_auto_without_calls_is_plain_text_and_whitespace_beside_calls_is_null() -> None:
    plan = ToolPlan("auto", parser="hermes")
    plain = same_answer(*run(plan, cut("Paris is sunny. <tool> is no marker.\n", 4)))
    assert plain == {**plain, "finish_reason": "stop"}
    assert plain["message"] == {"role": "assistant", "content": "Paris is sunny. <tool> is no marker.\n"}
    chunks, response = run(plan, ["\n", CALL, "\n\n"])
    assert same_answer(chunks, response)["message"]["content"] is None
    assert all("content" not in c["choices"][0]["delta"] or c["choices"][0]["delta"]["content"] == ""
               for c in chunks)


def test_a_call_cut_short_keeps_length_and_stays_content() -> None:
    plan = ToolPlan("auto", parser="llama3_json")
    whole = same_answer(*run(plan, ['{"name": "get_weather", ', '"parameters": {"ci'], finish="length"))
    assert whole["finish_reason"] == "length" and "tool_calls" not in whole["message"]
    assert whole["message"]["content"] == '{"name": "get_weather", "parameters": {"ci'


def test_without_parallel_calls_only_the_first_is_kept() -> None:
    whole = same_answer(*run(ToolPlan("auto", parser="hermes", parallel=False), cut(TWO, 7)))
    assert [c["function"]["name"] for c in whole["message"]["tool_calls"]] == ["get_weather"]


def test_named_function_streams_its_arguments_and_finishes_with_stop() -> None:
    plan = ToolPlan("named", function="get_weather", parallel=False, schema="{}")
    chunks, response = run(plan, ['{"ci', 'ty": "Pa', 'ris"}'])
    deltas = [c["choices"][0]["delta"]["tool_calls"] for c in chunks]
    assert deltas[0] == [{"index": 0, "id": deltas[0][0]["id"], "type": "function",
                          "function": {"name": "get_weather", "arguments": '{"ci'}}]
    assert deltas[1] == [{"index": 0, "function": {"arguments": 'ty": "Pa'}}]
    whole = same_answer(chunks, response)
    assert whole["finish_reason"] == "stop"  # OpenAI's for a forced named call
    assert json.loads(whole["message"]["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}


@pytest.mark.parametrize("parallel", [True, False])
def test_required_reads_the_constrained_calls(parallel: bool) -> None:
    calls = [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]
    output = json.dumps(calls if parallel else calls[0])
    whole = same_answer(*run(ToolPlan("required", parallel=parallel, schema="{}"), cut(output, 5)))
    assert whole["finish_reason"] == "tool_calls" and whole["message"]["content"] is None
    got = [{"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}
           for c in whole["message"]["tool_calls"]]
    assert got == (calls if parallel else calls[:1])


def test_each_choice_reads_its_own_calls() -> None:
    """n = 2, chunks interleaved: one choice calls a tool, the other answers in text; each choice has
    its own stream (calls, content, finish reason) in the chunks and in the response."""
    fmt = ChatFormatter(model="m", codec=FakeCodec(), prompt_tokens=3, logprobs=False, n=2,
                        tools=ToolCallStream(ToolPlan("auto", parser="hermes")))
    texts = {0: cut("Checking.\n" + TWO + "\n", 7), 1: cut("Paris is sunny.", 7)}
    chunks = []
    for k in range(max(len(t) for t in texts.values())):
        for i, pieces in texts.items():
            if k < len(pieces):
                end = "stop" if k == len(pieces) - 1 else None
                chunks.append(fmt.chunk(Delta(pieces[k], (65,), (None,), end, index=i)).model_dump())
    whole = fmt.response().model_dump()["choices"]
    assert [c["finish_reason"] for c in whole] == ["tool_calls", "stop"]
    assert [c["function"]["name"] for c in whole[0]["message"]["tool_calls"]] == ["get_weather", "get_time"]
    assert whole[1]["message"] == {"role": "assistant", "content": "Paris is sunny."}
    streamed = accumulated(chunks)["choices"]
    assert [calls_of(c["message"]) for c in streamed] == [calls_of(c["message"]) for c in whole]
