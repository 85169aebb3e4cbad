"""`router.responses.writer` against the official client: every event it writes validates as the
client's event type, and the client's own accumulator (`ResponseStreamState`, what
``responses.stream`` runs) builds from them exactly the response the writer answers unstreamed."""

from __future__ import annotations

import json
from typing import Any

import pytest
from openai import omit
from openai.lib._parsing._responses import parse_response
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from router.generation import Delta
from router.openai_format import ChatFormatter
from router.responses.objects import new_response
from router.responses.request import ResponsesRequest
from router.responses.writer import ResponseWriter
from router.tool_stream import ToolCallStream
from router.tools import ToolPlan
from tests.support.pd_fakes import FakeCodec

pytestmark = pytest.mark.timeout(30)

EVENTS: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def writer(plan: ToolPlan | None = None, prompt_tokens: int = 7, **fields: Any) -> ResponseWriter:
    req = ResponsesRequest.model_validate({"model": "m", "input": "hi", **fields})
    fmt = ChatFormatter(model="m", codec=FakeCodec(), prompt_tokens=prompt_tokens, logprobs=False,
                        tools=ToolCallStream(plan) if plan is not None else None)
    return ResponseWriter(new_response(req), fmt)


def deltas(text: str, reason: str, per: int = 3) -> list[Delta]:
    """``text`` a few characters (tokens of the fake codec) per Delta, the last with ``reason``."""
    pieces = [text[i:i + per] for i in range(0, len(text), per)] or [""]
    return [Delta(p, tuple(ord(c) for c in p), (None,) * len(p), reason if i == len(pieces) - 1 else None)
            for i, p in enumerate(pieces)]


def run(w: ResponseWriter, ds: list[Delta]) -> list[dict[str, Any]]:
    events = w.start()
    for d in ds:
        events += w.add(d)
    return events


def accumulate(events: list[dict[str, Any]]) -> dict[str, Any] | None:
    """What the official client's stream accumulator makes of the events (None: no response.completed)."""
    state: ResponseStreamState[Any] = ResponseStreamState(input_tools=omit, text_format=omit)
    for raw in events:
        state.handle_event(EVENTS.validate_python(json.loads(json.dumps(raw))))
    got = state._completed_response
    return None if got is None else got.model_dump()


def whole(w: ResponseWriter) -> Response:
    """The unstreamed response, as the client reads it."""
    return Response.model_validate(w.response().model_dump())


def parsed(response: Response) -> dict[str, Any]:
    """The unstreamed response as the client's ``responses.parse`` / stream accumulator present it."""
    return parse_response(text_format=omit, input_tools=omit, response=response).model_dump()


def test_a_text_answer_streams_in_openai_order_and_accumulates_to_the_whole_response() -> None:
    w = writer()
    events = run(w, deltas("Hello there, world", "stop"))
    assert [e["type"] for e in events[:4]] == ["response.created", "response.in_progress",
                                               "response.output_item.added", "response.content_part.added"]
    assert {e["type"] for e in events[4:-4]} == {"response.output_text.delta"}
    assert [e["type"] for e in events[-4:]] == ["response.output_text.done", "response.content_part.done",
                                                "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    got = whole(w)
    assert got.output_text == "Hello there, world" and got.status == "completed"
    assert got.usage is not None and (got.usage.input_tokens, got.usage.output_tokens) == (7, 18)
    assert accumulate(events) == parsed(got)


def test_a_cut_answer_is_incomplete_with_the_reason() -> None:
    w = writer(max_output_tokens=5)
    events = run(w, deltas("Hello", "length"))
    assert events[-1]["type"] == "response.incomplete"
    got = whole(w)
    assert got.status == "incomplete" and got.incomplete_details is not None
    assert got.incomplete_details.reason == "max_output_tokens" and got.output_text == "Hello"
    assert got.output[0].status == "incomplete"  # type: ignore[union-attr]
    assert events[-1]["response"] == w.response().model_dump()
    assert accumulate(events) is None  # the client's get_final_response() wants response.completed, as OpenAI's


def test_an_empty_answer_is_one_empty_message() -> None:
    w = writer()
    events = run(w, [Delta("", (0,), (None,), "stop")])
    got = whole(w)
    assert got.output_text == "" and len(got.output) == 1 and got.output[0].type == "message"
    assert accumulate(events) == parsed(got)


@pytest.mark.parametrize("per", [1, 4, 1000])
def test_text_then_a_parsed_call_become_a_message_and_a_function_call_item(per: int) -> None:
    plan = ToolPlan("auto", parser="hermes")
    w = writer(plan)
    events = run(w, deltas("Checking. " + CALL, "stop", per))
    got = whole(w)
    assert [i.type for i in got.output] == ["message", "function_call"]
    call = got.output[1]
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris"} and call.call_id.startswith("call_")
    assert got.output_text == "Checking." and got.status == "completed"
    kinds = [e["type"] for e in events]
    assert kinds.index("response.function_call_arguments.delta") > kinds.index("response.output_item.done")
    assert accumulate(events) == parsed(got)


def test_a_named_call_streams_its_arguments_piece_by_piece() -> None:
    plan = ToolPlan("named", function="get_weather", parallel=False, schema="{}")
    w = writer(plan)
    events = run(w, deltas('{"city": "Paris"}', "stop", 2))
    pieces = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
    assert len(pieces) > 1 and "".join(pieces) == '{"city": "Paris"}'
    done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
    assert done["arguments"] == '{"city": "Paris"}'
    got = whole(w)
    assert [(i.type, i.arguments) for i in got.output] == [("function_call", '{"city": "Paris"}')]  # type: ignore[union-attr]
    assert accumulate(events) == parsed(got)


def test_the_request_settings_are_echoed() -> None:
    w = writer(instructions="Be brief.", temperature=0.5, metadata={"k": "v"}, user="u1",
               text={"format": {"type": "json_object"}})
    got = whole(w)
    assert (got.instructions, got.temperature, got.metadata, got.user) == ("Be brief.", 0.5, {"k": "v"}, "u1")
    assert got.text is not None and got.text.format is not None and got.text.format.type == "json_object"
    assert got.id.startswith("resp_") and got.previous_response_id is None
