"""Fuzzing the router's HTTP API with schemathesis (and hypothesis): no 5xx, every error OpenAI-shaped.

The router app serves no ``/openapi.json`` (``openapi_url=None``) and its handlers read the body
themselves, so FastAPI's own schema has paths but no request bodies. `openapi_schema` builds the
document the fuzzer needs from the same two sources of truth: the app's routes (FastAPI's
``get_openapi``) and the pydantic request models the handlers validate with.

The app under test: the package's ``fakes`` app (see ``conftest.py``): the real router with the
tiny model's real tokenizer and chat template, fake pools (1 ms per token), a 256-token context.
Each operation gets schema-valid cases (``POSITIVE``) and schema-violating ones (``NEGATIVE``);
every response must be < 500, errors must carry ``{"error": {"message", "type", "param", "code"}}``
(429 with ``Retry-After``), and streams must end in ``data: [DONE]`` (the Responses API's: in
``response.completed`` / ``response.incomplete`` / ``error``, numbered from 0 without a gap).
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import schemathesis
from fastapi.openapi.utils import get_openapi
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel
from schemathesis.config import SchemathesisConfig

from router.app import app as router_app
from router.protocol import ChatCompletionRequest, CompletionRequest
from router.responses.request import ResponsesRequest
from router.tokenize import DetokenizeRequest, TokenizeCompletionRequest

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(240)]

BODIES: dict[str, type[BaseModel]] = {"/v1/completions": CompletionRequest,
                                      "/v1/chat/completions": ChatCompletionRequest,
                                      "/v1/responses": ResponsesRequest,
                                      "/tokenize": TokenizeCompletionRequest, "/detokenize": DetokenizeRequest}
EXAMPLES = {"POST": 40, "GET": 8}
ERROR_KEYS = {"message", "type", "param", "code"}
#: the last event of a streamed Response (OpenAI's: done, cut by max_output_tokens, or failed after token 0)
RESPONSE_ENDS = {"response.completed", "response.incomplete", "error"}
counts: dict[str, int] = {}


def openapi_schema() -> dict[str, Any]:
    """OpenAPI 3.1 for the router: FastAPI's paths plus the pydantic request bodies."""
    doc = get_openapi(title="pdserve", version="1", routes=router_app.routes)
    components: dict[str, Any] = {}
    for path, model in BODIES.items():
        body = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(body.pop("$defs", {}))
        components[model.__name__] = _deployment_facts(body)
        doc["paths"][path]["post"]["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}},
        }
    doc.setdefault("components", {})["schemas"] = components
    return doc


def _deployment_facts(body: dict[str, Any]) -> dict[str, Any]:
    """What this deployment accepts beyond the models' types: its served name and a 256-token context.

    Without them nearly every schema-valid case is a 404 (unknown model) or a 400 (too long), and
    the fuzzer would never reach the generation path.
    """
    props = body["properties"]
    props["model"] = {"type": "string", "const": "tiny"}
    for name in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        if name in props:
            props[name] = {"anyOf": [{"type": "integer", "minimum": 1, "maximum": 64}, {"type": "null"}]}
    return body


@pytest.fixture(scope="module")
def url(fakes_url: str) -> str:
    return fakes_url


def check_response(status: int, headers: dict[str, str], text: str, streamed: bool) -> None:
    assert status < 500, (status, text[:500])
    if status >= 400:
        err = json.loads(text)["error"]
        assert set(err) == ERROR_KEYS and isinstance(err["message"], str) and err["message"], text[:500]
        if status == 429:
            assert int(headers["retry-after"]) >= 1
    elif streamed and text.startswith("event: "):  # the Responses API: typed events, no [DONE]
        events = [json.loads(ln[6:]) for ln in text.splitlines() if ln.startswith("data: ")]
        assert events and events[-1]["type"] in RESPONSE_ENDS, text[-300:]
        assert [e["sequence_number"] for e in events] == list(range(len(events))), text[:300]
        if events[-1]["type"] == "error":
            assert events[-1]["message"], text[-300:]
    elif streamed:
        events = [ln[6:] for ln in text.splitlines() if ln.startswith("data: ")]
        assert events and events[-1] == "[DONE]", text[-300:]
        for e in events[:-1]:
            chunk = json.loads(e)
            if "error" in chunk:
                assert set(chunk["error"]) == ERROR_KEYS


# schemathesis (4.32 here) by default reads at most 20 events of an event stream, then closes the
# connection: our streams carry up to 255 tokens (max_tokens null: the rest of the 256-token context)
# plus the role, finish and usage chunks and [DONE], so it must read them whole (a cut stream is a
# client disconnect to the router: no [DONE]).
MAX_STREAM_EVENTS = 512
SCHEMA = schemathesis.openapi.from_dict(openapi_schema(),
                                        config=SchemathesisConfig.from_dict({"max-stream-events": MAX_STREAM_EVENTS}))
OPERATIONS = [(op.method.upper(), op.path, mode) for op in (r.ok() for r in SCHEMA.get_all_operations())  # type: ignore[union-attr]
              for mode in ([schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE]
                           if op.method.upper() == "POST" else [schemathesis.GenerationMode.POSITIVE])]


def test_schema_covers_every_route() -> None:
    paths = {p for _, p, _ in OPERATIONS}
    assert paths == {"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/responses/{response_id}",
                     "/v1/models", "/health", "/ready", "/metrics", "/tokenize", "/detokenize"}


@pytest.mark.parametrize(("method", "path", "mode"), OPERATIONS, ids=[f"{m} {p} {g.value}" for m, p, g in OPERATIONS])
def test_schemathesis(url: str, method: str, path: str, mode: schemathesis.GenerationMode) -> None:
    operation = SCHEMA[path][method.lower()]
    seen: list[int] = []
    codes: dict[str, int] = {}

    @settings(max_examples=EXAMPLES[method], deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case: schemathesis.Case) -> None:
        response = case.call(base_url=url, timeout=60)
        seen.append(response.status_code)
        assert not response.stream_cut_short, \
            f"schemathesis cut the stream short (at {MAX_STREAM_EVENTS} events or its 60 s timeout)"
        streamed = response.headers.get("content-type", [""])[0].startswith("text/event-stream") \
            if isinstance(response.headers.get("content-type"), list) \
            else str(response.headers.get("content-type", "")).startswith("text/event-stream")
        headers = {k.lower(): (v[0] if isinstance(v, list) else v) for k, v in response.headers.items()}
        check_response(response.status_code, headers, response.text, streamed)
        if response.status_code >= 400:
            code = str(json.loads(response.text)["error"]["param"] or json.loads(response.text)["error"]["code"])
            codes[code] = codes.get(code, 0) + 1

    run()
    by_status: dict[int, int] = {}
    for s in seen:
        by_status[s] = by_status.get(s, 0) + 1
    counts[f"{method} {path} {mode.value}"] = len(seen)
    print(f"schemathesis {method} {path} {mode.value}: {len(seen)} cases, statuses {dict(sorted(by_status.items()))}, "
          f"errors by param/code {codes}")
    assert seen


@settings(max_examples=60, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(body=st.one_of(st.binary(max_size=2000), st.text(max_size=500).map(str.encode),
                      st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False)
                                   | st.text(max_size=30),
                                   lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=10), kids,
                                                                                            max_size=4),
                                   max_leaves=12).map(lambda v: json.dumps(v).encode())),
       path=st.sampled_from(sorted(BODIES)))
def test_arbitrary_bodies(url: str, body: bytes, path: str) -> None:
    """Bytes that are not JSON, JSON that is not an object, objects of the wrong shape: all 4xx, shaped."""
    r = httpx.post(f"{url}{path}", content=body, headers={"Content-Type": "application/json"}, timeout=60)
    check_response(r.status_code, {k.lower(): v for k, v in r.headers.items()}, r.text,
                   r.headers.get("content-type", "").startswith("text/event-stream"))
    counts["arbitrary"] = counts.get("arbitrary", 0) + 1
