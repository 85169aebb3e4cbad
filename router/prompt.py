"""From a validated OpenAI request to what the pools take: prompt token ids and sampling params.

Owns: `completion_prompt`, `chat_prompt` (the chat template is applied here, in the router) and
`sampling_for`, which enforces the context bound and fills the sampling settings a request left unset
from the model's generation config, and the request's grammar (`router.response_format.grammar_for`).

Invariants: a prompt is never empty and fits ``max_model_len`` with room for at least one token;
``prompt + max_tokens <= max_model_len`` when the client set ``max_tokens`` (otherwise the
request gets the rest of the context, capped by the configured default, else by the model's
``max_new_tokens``); token ids sent by the client are inside the vocabulary. A text prompt gets
what the tokenizer's post-processor adds (BOS for Llama-style tokenizers, never doubled), token ids
are taken as given, and a chat gets only what its template writes. Violations are 400s with OpenAI's wording and codes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from engine.sampling.sampler import SamplingDefaults, SamplingParams
from router.codec import TextCodec
from router.errors import bad_request, context_too_long
from router.protocol import ChatCompletionRequest, CompletionRequest, GenerationRequest
from router.response_format import grammar_for


def completion_prompt(req: CompletionRequest, codec: TextCodec) -> tuple[int, ...]:
    prompt = req.prompt
    if isinstance(prompt, str):
        ids = codec.encode_prompt(prompt)
    elif isinstance(prompt[0], str):
        ids = codec.encode_prompt(str(prompt[0]))
    else:
        ids = [int(t) for t in prompt]
        _in_vocab(ids, codec.vocab_size, "prompt")
    if not ids:
        raise bad_request("the prompt encodes to no tokens", param="prompt")
    return tuple(ids)


def echo_text(req: CompletionRequest, prompt: tuple[int, ...], codec: TextCodec) -> str:
    """What ``echo`` sends back: the prompt text as the client gave it, token ids decoded."""
    if isinstance(req.prompt, str):
        return req.prompt
    if isinstance(req.prompt[0], str):
        return str(req.prompt[0])
    return codec.decode(list(prompt))


def chat_prompt(req: ChatCompletionRequest, codec: TextCodec,
                tools: Sequence[Mapping[str, Any]] = ()) -> tuple[int, ...]:
    """The chat's ids; ``tools`` (`router.tools.ToolPlan.template_tools`) reach the template's ``tools``."""
    try:
        ids = codec.encode_chat([m.to_template() for m in req.messages], tools=tools or None)
    except ValueError as e:  # no chat template, or a template's raise_exception (bad role order)
        raise bad_request(str(e), param="messages") from None
    if not ids:
        raise bad_request("the messages encode to no tokens", param="messages")
    return tuple(ids)


def _in_vocab(ids: Iterable[int], vocab_size: int, param: str) -> None:
    bad = next((t for t in ids if t >= vocab_size), None)
    if bad is not None:
        raise bad_request(f"token id {bad} is outside the vocabulary (size {vocab_size})", param=param)


def sampling_for(
    req: GenerationRequest,
    prompt_len: int,
    max_model_len: int,
    default_max_tokens: int | None,
    eos_token_ids: tuple[int, ...],
    logprobs: bool,
    vocab_size: int,
    top_logprobs: int = 0,
    defaults: SamplingDefaults | None = None,
) -> SamplingParams:
    """The request's sampling settings; EOS joins the stop ids unless ``ignore_eos`` (vLLM: the
    requested ``stop_token_ids`` stop the sequence either way); ``defaults`` (the model's generation
    config) fill temperature / top_p / top_k / min_p / repetition_penalty the request left unset.
    ``max_tokens`` left unset: the configured ``default_max_tokens``, else the model's
    ``max_new_tokens`` (as vLLM takes it), else the rest of the context; each at most that rest."""
    room = max_model_len - prompt_len
    if room < 1:
        raise context_too_long(
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt has "
            f"{prompt_len} tokens, which leaves no room for a completion. Please reduce the length of "
            f"the prompt.")
    requested = req.requested_max_tokens
    if requested is None:
        default = default_max_tokens if default_max_tokens is not None else defaults.max_tokens if defaults else None
        max_tokens = room if default is None else min(room, default)
    elif requested > room:
        raise context_too_long(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} in the "
            f"completion). Please reduce the length of the prompt or completion.")
    else:
        max_tokens = requested
    _in_vocab(req.stop_token_ids or (), vocab_size, "stop_token_ids")
    _in_vocab(req.logit_bias or (), vocab_size, "logit_bias")
    stop_ids = tuple(dict.fromkeys([*(req.stop_token_ids or ()), *(() if req.ignore_eos else eos_token_ids)]))
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=_setting(req, "temperature", defaults),
            top_p=_setting(req, "top_p", defaults),
            top_k=_setting(req, "top_k", defaults),
            seed=req.seed,
            min_p=_setting(req, "min_p", defaults),
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            repetition_penalty=_setting(req, "repetition_penalty", defaults),
            logit_bias=tuple(sorted((req.logit_bias or {}).items())),
            min_tokens=req.min_tokens,
            stop_token_ids=stop_ids,
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            top_logprobs=top_logprobs if logprobs else 0,
            grammar=grammar_for(req.response_format),
        )
    except ValueError as e:
        raise bad_request(str(e)) from None



def _setting(req: GenerationRequest, name: str, defaults: SamplingDefaults | None) -> Any:
    """The request's value when it sent one, else the model's default, else the API's default."""
    model_value = None if defaults is None else getattr(defaults, name)
    if name in req.model_fields_set or model_value is None:
        return getattr(req, name)
    return model_value
