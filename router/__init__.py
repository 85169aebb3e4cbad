"""The HTTP router: OpenAI-compatible API, SSE, routing policies, metrics. Holds no model weights.

Modules (request order):
  protocol       request / response / chunk models (pydantic, OpenAI's shapes)
  errors         APIError and the OpenAI error body for every status we answer with
  config         RouterConfig (one frozen object per router replica)
  codec          the tokenizer the router uses: chat template, encode, incremental detokenizer
  prompt         request → prompt token ids + SamplingParams, with the context bound
  response_format structured outputs: response_format → GrammarSpec, compiled before any prefill
  backends       the prefill/decode handle calls: timeouts, one retry, cancellation
  generation     one request's stream: prefill → token 0 → decode events → Deltas (stops, EOS, metrics)
  stops          stop strings with hold-back
  openai_format  Deltas → chunks / responses, SSE framing
  responses      OpenAI's Responses API (/v1/responses): the chat request it means, Response objects, events
  metrics        Prometheus registry per replica; per-replica gauges from the load board
  policy         pure routing policies over LoadReports
  replica_router Serve RequestRouter adapter running those policies; routing stats = load()
  loadboard      the latest LoadReports seen by this process (for /metrics)
  app            FastAPI app + the Router Serve ingress deployment
"""
