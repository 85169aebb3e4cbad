"""Every request field accounted for: served, refused with a 400 naming it, or ignored for a reason.

Owns: `account(payload, served)`, run on a request body before it is validated, and the tables
behind it. A field is one of

- **served**: declared on the request model in `router.protocol` and honoured as OpenAI defines it
  (vLLM's definition where OpenAI has none);
- **refused** (`REFUSED`, on an endpoint whose request model does not serve it): accepted only at
  its default (absent, ``null`` or a listed value); any other value is a 400 whose message and
  ``param`` name the field;
- **ignored** (`IGNORED`): metadata that OpenAI documents as not changing the output;
- **unknown**: anything else (a vendor's extension we do not know): dropped, with a warning in the
  log, as vLLM does.

Invariants: no name is in two tables, none of `IGNORED` is a field of the request models, and a
`REFUSED` name is a field of at most one of them (``echo``: completions; ``tools``, ``tool_choice``,
``parallel_tool_calls``: chat); tests check these, and that every field of the official client's
request types is here.

Served fields (both endpoints unless marked):

| field | notes |
|---|---|
| model, messages (chat), prompt (completions) | one prompt per request |
| n | 1..16 (<= decode.max_num_seqs): one prefill, KV forked per choice; per-choice seeds (`engine.sampling.choices`) |
| max_tokens, max_completion_tokens (chat) | the latter wins when both are set |
| temperature, top_p, seed, stop | OpenAI's ranges; at most 4 stop strings |
| frequency_penalty, presence_penalty | -2..2, over the output tokens (OpenAI's formula) |
| logit_bias | token id -> -100..100, added to the logits before the penalties and sampling |
| logprobs, top_logprobs (chat, <= 20) | the chosen token's and the k most likely, unmodified distribution |
| logprobs k (completions, <= 5) | the same; each token's dict holds the k most likely and the chosen one |
| stream, stream_options.include_usage | (include_obfuscation: wire padding, ignored) |
| echo (completions) | the prompt's text first; with logprobs, the prompt's tokens lead (the first: null) |
| prompt_logprobs (<= 20) | vLLM's shape, on the completions choice / chat response; not with stream |
| top_k, min_p, repetition_penalty, min_tokens | vLLM's extensions, as vLLM defines them |
| ignore_eos, stop_token_ids | vLLM's extensions, as vLLM defines them |
| skip_special_tokens, include_stop_str_in_output | vLLM's extensions, as vLLM defines them |
| response_format | text, json_object, json_schema (always enforced) by llguidance; uncompilable: 400 |
| tools, tool_choice, parallel_tool_calls (chat) | function tools; none, auto, required, named: `router.tools` |
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from router.errors import APIError, bad_request

logger = logging.getLogger("pdserve.router")

@dataclass(frozen=True)
class Refused:
    """A field served only at its default: ``null`` / absent or one of ``defaults``."""

    why: str
    defaults: tuple[Any, ...] = ()

    def allows(self, value: Any) -> bool:
        return value is None or any(type(value) is type(d) and value == d for d in self.defaults)


#: an endpoint's own (refused, ignored) tables, for `account`
FieldTables = tuple[Mapping[str, Refused], Mapping[str, str]]

_GUIDED = Refused("only response_format's json_object and json_schema constrain the output")

# Refused unless at their default: each would change the output in a way we do not build (yet).
REFUSED: dict[str, Refused] = {
    # OpenAI, completions
    "best_of": Refused("ranking candidates by log-prob on the server is not supported", (1,)),
    "echo": Refused("echo is served on /v1/completions only", (False,)),
    "suffix": Refused("the model has no insert (suffix) mode", ("",)),
    # OpenAI, chat
    "tools": Refused("tools are served on /v1/chat/completions only", ([],)),
    "tool_choice": Refused("tool_choice is served on /v1/chat/completions only", ("none", "auto")),
    "parallel_tool_calls": Refused("parallel_tool_calls is served on /v1/chat/completions only", (True,)),
    "functions": Refused("function calling is not supported", ([],)),
    "function_call": Refused("function calling is not supported", ("none", "auto")),
    "audio": Refused("audio output is not supported", ()),
    "modalities": Refused("only text output is supported", (["text"],)),
    "reasoning_effort": Refused("the model does not reason; only 'none'", ("none",)),
    "verbosity": Refused("verbosity is not adjustable; only 'medium'", ("medium",)),
    "web_search_options": Refused("web search is not supported", ()),
    "moderation": Refused("moderation is not supported", ()),
    # vLLM's extensions that change the output
    "use_beam_search": Refused("beam search is not supported", (False,)),
    "length_penalty": Refused("length_penalty needs beam search, which is not supported", (1.0, 1)),
    "allowed_token_ids": Refused("allowed_token_ids is not supported", ([],)),
    "bad_words": Refused("bad_words is not supported", ([],)),
    "guided_json": _GUIDED,
    "guided_regex": _GUIDED,
    "guided_choice": _GUIDED,
    "guided_grammar": _GUIDED,
    "structured_outputs": _GUIDED,
    "logits_processors": Refused("custom logits processors are not supported", ([],)),
    "truncate_prompt_tokens": Refused("prompt truncation is not supported", ()),
    "spaces_between_special_tokens": Refused("special tokens are always decoded without added spaces",
                                             (True,)),
    "return_tokens_as_token_ids": Refused("log-prob tokens are always text", (False,)),
    "add_special_tokens": Refused("no special tokens are added to a prompt (a chat prompt has the "
                                  "template's own)", (False,)),
    "add_generation_prompt": Refused("the chat template always adds the generation prompt", (True,)),
    "continue_final_message": Refused("continuing the final message is not supported", (False,)),
    "chat_template": Refused("the served model's chat template is the only one", ("",)),
    "chat_template_kwargs": Refused("the chat template takes no extra arguments", ({},)),
    "documents": Refused("documents for the chat template are not supported", ([],)),
}

# Accepted and ignored: OpenAI documents none of these as changing the generated text.
IGNORED: dict[str, str] = {
    "user": "an end-user id for abuse monitoring (deprecated for safety_identifier)",
    "safety_identifier": "an end-user id for abuse monitoring",
    "metadata": "key-value tags stored with the completion",
    "store": "whether OpenAI stores the completion for distillation / evals",
    "service_tier": "the processing tier (latency and price), not the output",
    "prompt_cache_key": "a prompt-cache routing hint",
    "prompt_cache_retention": "how long a cached prompt is kept",
    "prompt_cache_options": "prompt-cache settings",
    "prediction": "a Predicted Output: speeds the response up, does not change it",
    # vLLM's scheduling / plumbing extras
    "priority": "vLLM's scheduling priority",
    "request_id": "vLLM's request id; ours are generated",
    "cache_salt": "vLLM's prefix-cache isolation salt",
}


def account(payload: Any, served: frozenset[str], refused_fields: Mapping[str, Refused] | None = None,
            ignored_fields: Mapping[str, str] | None = None) -> None:
    """Raise a 400 for the first refused field set away from its default; log unknown fields.

    ``served``: the request model's own field names (validated by pydantic after this);
    ``refused_fields`` / ``ignored_fields``: an endpoint's own tables (default: `REFUSED` and
    `IGNORED`, the completions and chat endpoints'; `router.responses.fields` has the Responses API's).
    """
    refused_fields = REFUSED if refused_fields is None else refused_fields
    ignored_fields = IGNORED if ignored_fields is None else ignored_fields
    if not isinstance(payload, Mapping):
        return  # pydantic says what is wrong with it
    unknown: list[str] = []
    for name, value in payload.items():
        if name in served:
            continue
        rule = refused_fields.get(name)
        if rule is not None:
            if not rule.allows(value):
                raise refused(name, rule.why)
        elif name not in ignored_fields:
            unknown.append(str(name))
    if unknown:
        logger.warning("The following fields were present in the request but ignored: %s", sorted(unknown))


def refused(name: str, why: str) -> APIError:
    return bad_request(f"{name}: {why}.", param=name, code="unsupported_parameter")
