"""OpenAI's Responses API (``POST /v1/responses``) on the chat completions path.

A Responses request is turned into the chat completions request it means (`convert`), so the
prompt, the tools, the grammar and the sampling settings are made in the one place chat makes them
(`router.prompt`, `router.tools`, `router.response_format`); what comes back is the same stream of
`router.generation.Delta`s, written as a Response object or its stream of events (`writer`).

Modules:
  fields    the Responses body's fields: refused unless at their default, or ignored (the tables
            `router.fields.account` reads for this endpoint)
  request   `ResponsesRequest`: the fields we serve and their input items, validated
  convert   `ResponsesRequest` → `ChatCompletionRequest` (instructions, input items, tools,
            tool_choice, text.format, max_output_tokens)
  objects   the Response object and its output items, as the official client reads them
  writer    `ResponseWriter`: Deltas → output items, the stream's events (with sequence numbers),
            the final Response (status, incomplete_details, usage)
  relay     the Deltas relayed to the client: the SSE body (the decode stream closed whatever
            happens), or the whole Response

Nothing is stored: ``store`` is accepted and has no effect, ``previous_response_id`` is a 400 and
``GET /v1/responses/{id}`` a 404 (docs/responses.md).
"""
