"""The Responses API body's fields beyond the ones `router.responses.request` serves.

Owns: `REFUSED` and `IGNORED` for ``POST /v1/responses``, in `router.fields`' terms: a refused field
is accepted only at its default (absent, ``null`` or a listed value), any other value is a 400
naming it; an ignored one is metadata OpenAI documents as not changing the output. Unknown fields
are dropped with a warning, as on the other endpoints.

Invariants: no name is in both tables, none is a field of `ResponsesRequest`, and every field of
the official client's ``responses.create`` parameters is served, refused or ignored (tests check
all three). Nothing is stored, so everything that reads a stored response or conversation is
refused (``previous_response_id``, ``conversation``, ``background``).
"""

from __future__ import annotations

from router.fields import Refused

_STORED = "responses are not stored on this server"

REFUSED: dict[str, Refused] = {
    "previous_response_id": Refused(f"{_STORED}; send the whole conversation as input"),
    "conversation": Refused("conversations are not stored on this server; send the whole "
                            "conversation as input"),
    "background": Refused(f"background responses need a stored response, and {_STORED}", (False,)),
    "background_options": Refused("background responses are not supported", ({},)),
    "reasoning": Refused("the model does not reason; reasoning settings are not supported", ({},)),
    "include": Refused("no extra output data (log-probs, reasoning, tool results) is served", ([],)),
    "top_logprobs": Refused("log-probs are not served on /v1/responses; use /v1/chat/completions", (0,)),
    "max_tool_calls": Refused("built-in tools are not supported, so their call count is not bounded"),
    "prompt": Refused("stored prompt templates are not supported; send instructions and input"),
    "truncation": Refused("the input is never truncated; only 'disabled'", ("disabled",)),
    "context_management": Refused("context management (compaction) is not supported", ([],)),
    "moderation": Refused("moderation is not supported"),
    "image": Refused("image output is not supported"),
    "access_programs": Refused("access programs are not supported"),
    # chat completions' names for what this endpoint calls otherwise: refused, not silently dropped
    "messages": Refused("/v1/responses takes 'input' (and 'instructions'), not 'messages'", ([],)),
    "max_tokens": Refused("/v1/responses takes 'max_output_tokens'"),
    "max_completion_tokens": Refused("/v1/responses takes 'max_output_tokens'"),
    "response_format": Refused("/v1/responses takes 'text.format'"),
}

IGNORED: dict[str, str] = {
    "safety_identifier": "an end-user id for abuse monitoring",
    "service_tier": "the processing tier (latency and price), not the output",
    "prompt_cache_key": "a prompt-cache routing hint",
    "prompt_cache_retention": "how long a cached prompt is kept",
    "prompt_cache_options": "prompt-cache settings",
    "stream_options": "include_obfuscation: padding for the wire, not the text",
}
