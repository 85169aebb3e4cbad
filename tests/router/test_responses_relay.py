"""`router.responses.relay` over `Generation` with in-process stand-ins for the pools (no Ray): a
failure after the first token is one ``error`` event that ends the stream, a client that leaves
cancels the decode stream, and the whole response is the stream's final one."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from engine.sampling.sampler import SamplingParams
from router.backends import Backends
from router.errors import APIError
from router.generation import Generation, GenerationInput
from router.metrics import RouterMetrics
from router.openai_format import ChatFormatter
from router.reply import stream_error
from router.responses.objects import new_response
from router.responses.relay import stream_events, whole_response
from router.responses.request import ResponsesRequest
from router.responses.writer import ResponseWriter
from tests.support.fake_handles import FakeHandle
from tests.support.pd_fakes import FakeCodec, FakeDecode, FakePrefill, expected_text

pytestmark = pytest.mark.timeout(30)


def setup(prompt: str, max_tokens: int = 8) -> tuple[Any, ResponseWriter, FakeDecode]:
    decode = FakeDecode(None)
    backends = Backends(FakeHandle(FakePrefill(None)), FakeHandle(decode), 5.0, 5.0, 1.0)
    gen = Generation(backends, FakeCodec(), RouterMetrics())
    writer = ResponseWriter(new_response(ResponsesRequest.model_validate({"model": "m", "input": prompt})),
                            ChatFormatter(model="m", codec=FakeCodec(), prompt_tokens=len(prompt), logprobs=False))
    inp = GenerationInput(request_id=writer.id, prompt_token_ids=tuple(ord(c) for c in prompt),
                          sampling=SamplingParams(max_tokens=max_tokens, stop_token_ids=(0,)))
    return gen.stream(inp), writer, decode


def events(body: list[str]) -> list[dict[str, Any]]:
    out = []
    for chunk in body:
        kind, data = chunk.strip().split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert kind == f"event: {event['type']}"
        out.append(event)
    return out


async def test_the_whole_response_is_the_streams_final_one() -> None:
    deltas, writer, _ = setup("abc", max_tokens=6)
    whole = await whole_response(await deltas.__anext__(), deltas, writer, stream_error)
    assert whole.status == "incomplete" and whole.output[0].content[0].text == expected_text("abc", 6)  # type: ignore[union-attr]
    deltas, writer, _ = setup("abc", max_tokens=6)
    body = [s async for s in stream_events(await deltas.__anext__(), deltas, writer, stream_error)]
    final = events(body)[-1]
    assert final["type"] == "response.incomplete"
    assert final["response"]["output"][0]["content"][0]["text"] == whole.output[0].content[0].text  # type: ignore[union-attr]


async def test_a_failure_after_the_first_token_is_one_error_event() -> None:
    deltas, writer, _ = setup("MIDERR", max_tokens=20)
    body = [s async for s in stream_events(await deltas.__anext__(), deltas, writer, stream_error)]
    got = events(body)
    assert got[-1]["type"] == "error" and "fake decode failure" in got[-1]["message"]
    assert [e["sequence_number"] for e in got] == list(range(len(got)))
    deltas, writer, _ = setup("MIDERR", max_tokens=20)
    with pytest.raises(APIError) as e:
        await whole_response(await deltas.__anext__(), deltas, writer, stream_error)
    assert e.value.status == 500 and "fake decode failure" in e.value.message


async def test_a_client_leaving_cancels_the_decode_stream() -> None:
    deltas, writer, decode = setup("SLOWxyz", max_tokens=150)
    body = stream_events(await deltas.__anext__(), deltas, writer, stream_error)
    for _ in range(8):  # created, in_progress, the message opened, then text deltas from the decode stream
        await body.__anext__()
    await body.aclose()  # what Starlette does when the client goes away
    for _ in range(100):
        if writer.id in await decode.cancelled():
            break
        await asyncio.sleep(0.02)
    assert writer.id in await decode.cancelled()
