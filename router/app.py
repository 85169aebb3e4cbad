"""The HTTP ingress: OpenAI-compatible endpoints on FastAPI, served by the `Router` deployment.

Owns: the FastAPI ``app`` and `Router(prefill_handle, decode_handle, config)`, the Serve ingress
class (stateless; any number of replicas behind any load balancer).

Per request: auth (Bearer key, constant-time compare) → the body (`router.request_body`: ≤
``max_body_bytes``, else 413; every field accounted for; validated, 400 in OpenAI's shape; model name,
404) → chat template + tokenize → context bound (400 ``context_length_exceeded``) → `Generation`
(`router.reply`: admission, 429 past ``max_inflight_requests``; the path, `router.path_choice`,
disaggregated under ``prefill_path: auto``; REMOTE: prefill, token 0 sent at once, decode stream
relayed; LOCAL: the decode stream alone) → SSE chunks ending in ``data: [DONE]``, or one JSON response.

Readiness: ``/health`` says the process answers; ``/ready`` says to send traffic here. ``/ready`` is
503 while the app's drain flag is set (`router.drain`) — the first thing a drain changes, so a load
balancer stops sending before anything stops serving — and while either pool does not answer.

``/v1/responses`` (OpenAI's Responses API, `router.responses`): its own field tables, then the chat
completions request it means through the same steps; its events or one Response object (nothing is
stored: ``GET /v1/responses/{id}`` is a 404).

Also vLLM's ``/tokenize`` and ``/detokenize`` (`router.tokenize`), through the same auth, field
accounting and validation.

Errors are raised as `router.errors.APIError` and answered by the app's exception handlers
(`install_handlers`), so no endpoint formats one itself.

Invariants: every key is compared, with no early exit (the time taken says nothing of the keys);
public paths are matched without Serve's route prefix; errors before the first token get their real
status, after it a stream ends in an error event (`router.reply`).
"""

# No ``from __future__ import annotations`` here: Serve ships the ingress class by value, cloudpickle
# keeps only the globals a function's code uses, and FastAPI resolves string annotations (``Request``)
# from those globals, so postponed annotations would turn ``request: Request`` into a query parameter.

import hmac
import time
from collections.abc import Callable
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from ray import serve

from engine.sampling.grammar import GrammarSpec
from router.admission import Admission
from router.backends import Backends
from router.codec import TextCodec, load_codec
from router.config import RouterConfig
from router.drain import DrainFlag, current_app_name
from router.errors import bad_request, draining, install_handlers, not_stored, unauthorized, unavailable
from router.fields import FieldTables
from router.generation import Generation
from router.metrics import CONTENT_TYPE, RouterMetrics
from router.openai_format import ChatFormatter, CompletionFormatter, Formatter
from router.openai_objects import ModelCard, ModelList
from router.path_choice import PathChoice
from router.prompt import chat_prompt, completion_prompt, echo_text
from router.protocol import ChatCompletionRequest, CompletionRequest, GenerationRequest
from router.reply import SSE_HEADERS, Replies, stream_error
from router.request_body import parse_body, route_path, tokenize_kind
from router.responses.convert import to_chat
from router.responses.fields import IGNORED as RESPONSES_IGNORED
from router.responses.fields import REFUSED as RESPONSES_REFUSED
from router.responses.objects import new_response
from router.responses.relay import stream_events, whole_response
from router.responses.request import ResponsesRequest
from router.responses.writer import ResponseWriter
from router.tokenize import DetokenizeRequest, detokenize, tokenize
from router.tool_stream import ToolCallStream
from router.tools import ToolPlan, plan_tools, tool_grammar

app = FastAPI(title="pdserve", docs_url=None, redoc_url=None, openapi_url=None)
install_handlers(app)

_FALLBACK_MAX_MODEL_LEN = 2048

R = TypeVar("R", bound=GenerationRequest)
M = TypeVar("M", bound=BaseModel)


@serve.deployment(ray_actor_options={"num_cpus": 0.1}, max_ongoing_requests=1000)
@serve.ingress(app)
class Router:
    def __init__(self, prefill_handle: Any | None, decode_handle: Any, config: RouterConfig,
                 codec_factory: Callable[[RouterConfig], TextCodec] | None = None) -> None:
        if (prefill_handle is None) != (config.mode == "colocated"):
            raise ValueError(f"mode {config.mode!r} needs {'no' if config.mode == 'colocated' else 'a'} "
                             "prefill handle")
        self._config = config
        self._codec = codec_factory(config) if codec_factory is not None else load_codec(config)
        self._max_model_len = config.max_model_len or self._codec.max_model_len or _FALLBACK_MAX_MODEL_LEN
        names = [h.deployment_name for h in (prefill_handle, decode_handle) if h is not None]
        self._metrics = RouterMetrics(load_deployments=names)
        self._backends = Backends(prefill_handle, decode_handle, config.prefill_timeout_s,
                                  config.token_timeout_s, config.ready_timeout_s)
        self._admission = Admission(config.max_inflight_requests)
        choice = None
        if prefill_handle is not None and config.prefill_path == "auto":
            choice = PathChoice(config.path_policy, prefill_handle.deployment_name, decode_handle.deployment_name,
                                self._metrics)
        self._generation = Generation(self._backends, self._codec, self._metrics, self._admission,
                                      config.migration_limit, choice)
        self._replies = Replies(config, self._codec, self._max_model_len, self._generation)
        self._keys = tuple(k.encode() for k in config.api_keys)
        self._drain = DrainFlag(current_app_name())
        self._metrics.track_in_flight(lambda: self._admission.in_flight)

    # ---- guards ----
    def _authorize(self, request: Request) -> None:
        if not self._keys or route_path(request) in self._config.public_paths:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        given = token.strip().encode() if scheme.lower() == "bearer" else b""
        ok = False
        for key in self._keys:  # no early exit: the time taken does not say which key came close
            ok |= hmac.compare_digest(given, key)
        if not ok:
            raise unauthorized()

    async def _validate(self, request: Request, pick: Callable[[Any], type[M]],
                        fields: FieldTables | None = None) -> M:
        """Auth, the body (size, JSON), every field accounted for, validation, the model name (when
        the body names one). ``pick``: the request model for this body; ``fields``: the endpoint's
        refused and ignored fields (default: chat's and completions')."""
        self._authorize(request)
        return await parse_body(request, pick, self._config.max_body_bytes, self._config.served_model_name, fields)

    async def _parse(self, request: Request, model: type[R]) -> R:
        return await self._validate(request, lambda _: model)

    # ---- OpenAI endpoints ----
    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        req: CompletionRequest = await self._parse(request, CompletionRequest)
        prompt = completion_prompt(req, self._codec)
        k = req.prompt_logprobs_k
        fmt: Formatter = CompletionFormatter(
            model=req.model, codec=self._codec, prompt_tokens=len(prompt),
            logprobs=req.logprobs is not None, top_logprobs=req.logprobs or 0, include_usage=req.include_usage,
            echo=echo_text(req, prompt, self._codec) if req.echo else "",
            echo_logprobs=req.echo and req.logprobs is not None, prompt_ids=prompt if k is not None else (),
            n=req.n)
        return await self._run(req.stream, prompt, req, fmt, k)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        req, tools, grammar, prompt = await self._chat(await self._parse(request, ChatCompletionRequest))
        fmt: Formatter = ChatFormatter(model=req.model, codec=self._codec, prompt_tokens=len(prompt),
                                       logprobs=req.logprobs, top_logprobs=req.top_logprobs or 0,
                                       include_usage=req.include_usage,
                                       prompt_ids=prompt if req.prompt_logprobs is not None else (),
                                       tools=ToolCallStream(tools) if tools.reads_calls else None, n=req.n)
        return await self._run(req.stream, prompt, req, fmt, req.prompt_logprobs, grammar)

    async def _chat(self, req: ChatCompletionRequest
                    ) -> tuple[ChatCompletionRequest, ToolPlan, GrammarSpec | None, tuple[int, ...]]:
        """A chat request's tools (checked against the template), a forced call's grammar, the prompt."""
        tools = plan_tools(req, self._codec)
        if tools.keep_special_tokens:  # the tool-call markers are special tokens: the parser must see them
            req = req.model_copy(update={"skip_special_tokens": False})
        grammar = await tool_grammar(tools, req, self._codec)
        return req, tools, grammar, chat_prompt(req, self._codec, tools.template_tools)

    @app.post("/v1/responses")
    async def responses(self, request: Request) -> Response:
        """OpenAI's Responses API: the chat request it means (`router.responses.convert`), on the chat path."""
        req = await self._validate(request, lambda _: ResponsesRequest, (RESPONSES_REFUSED, RESPONSES_IGNORED))
        chat, tools, grammar, prompt = await self._chat(to_chat(req))
        skeleton = new_response(req)
        writer = ResponseWriter(skeleton, ChatFormatter(
            model=req.model, codec=self._codec, prompt_tokens=len(prompt), logprobs=False, id=skeleton.id,
            tools=ToolCallStream(tools) if tools.reads_calls else None))
        first, deltas = await self._replies.start(prompt, chat, writer.formatter, None, grammar)
        if chat.stream:
            return StreamingResponse(stream_events(first, deltas, writer, stream_error), media_type="text/event-stream",
                                     headers=SSE_HEADERS)
        return JSONResponse((await whole_response(first, deltas, writer, stream_error)).model_dump())

    @app.get("/v1/responses/{response_id}")
    async def get_response(self, request: Request, response_id: str) -> Response:
        """Nothing is stored (docs/responses.md): a 404 saying so."""
        self._authorize(request)
        raise not_stored(response_id)

    async def _run(self, stream: bool, prompt: tuple[int, ...], req: GenerationRequest, fmt: Formatter,
                   prompt_logprobs: int | None, grammar: GrammarSpec | None = None) -> Response:
        """A completion or chat completion: SSE chunks ending in ``[DONE]``, or one JSON response."""
        if req.n > self._config.max_choices:  # a decode replica runs every choice of a request at once
            raise bad_request(f"n: at most {self._config.max_choices} choices per request are served", param="n")
        first, deltas = await self._replies.start(prompt, req, fmt, prompt_logprobs, grammar)
        return await self._replies.answer(stream, first, deltas, fmt)

    # ---- vLLM's tokenizer endpoints ----
    @app.post("/tokenize")
    async def post_tokenize(self, request: Request) -> Response:
        req = await self._validate(request, tokenize_kind)
        return JSONResponse(tokenize(req, self._codec, self._max_model_len).model_dump())

    @app.post("/detokenize")
    async def post_detokenize(self, request: Request) -> Response:
        req = await self._validate(request, lambda _: DetokenizeRequest)
        return JSONResponse(detokenize(req, self._codec).model_dump())

    # ---- service endpoints ----
    @app.get("/v1/models")
    async def models(self, request: Request) -> Response:
        self._authorize(request)
        card = ModelCard(id=self._config.served_model_name, created=int(time.time()),
                         max_model_len=self._max_model_len)
        return JSONResponse(ModelList(data=[card]).model_dump())

    @app.get("/health")
    async def health(self, request: Request) -> Response:
        self._authorize(request)
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready(self, request: Request) -> Response:
        self._authorize(request)
        if self._drain.is_set():
            raise draining()
        if not await self._backends.ready():
            raise unavailable("The prefill or decode pool is not ready.")
        return JSONResponse({"status": "ready"})

    @app.get("/metrics")
    async def metrics(self, request: Request) -> Response:
        self._authorize(request)
        return Response(self._metrics.render(), media_type=CONTENT_TYPE)
