"""The OpenAI-compatible requests: ``/v1/completions`` and ``/v1/chat/completions`` bodies, validated.

Owns: `CompletionRequest` and `ChatCompletionRequest`, which follow OpenAI's fields so the official
clients' bodies parse; the objects we answer with are in `router.openai_objects`. A chat's messages
are `router.messages.ChatMessage`; the tool-calling shapes (tools, tool choice, calls and their
deltas) come from `router.tool_protocol`.

Invariants: the fields declared here are the ones we serve; `router.fields.account` has checked
every other field of the body before these models see it (refused ones at a non-default value are a
400, the rest are dropped), so ``extra="ignore"`` drops nothing unaccounted for. A request that
passes validation has a ``max_tokens`` that is None or >= 1, at most 4 non-empty stop strings, a
non-empty prompt, ``n`` in 1..16 (`engine.sampling.choices.MAX_CHOICES`), only text content, ``logit_bias``
values in -100..100, ``min_tokens`` no larger than ``max_tokens``, no ``prompt_logprobs`` on a
stream (vLLM's rule), a ``response_format`` of a served type and shape and ``tool_calls`` only on
assistant messages; what needs the tokenizer or the served name (token ids inside the vocabulary,
context length, model name, whether llguidance compiles the schema, what the chat template renders)
is checked by the app.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from engine.sampling.choices import MAX_CHOICES
from router.messages import ChatMessage
from router.response_format import ResponseFormat
from router.tool_protocol import NamedToolChoice, ToolDef


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")  # include_obfuscation: padding for the wire, not the text
    include_usage: bool = False


class GenerationRequest(BaseModel):
    """Fields both endpoints share."""

    model_config = ConfigDict(extra="ignore")

    model: str
    n: int = Field(default=1, ge=1, le=MAX_CHOICES, strict=True)  # choices, one prefill (`engine.sampling.choices`)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[int, float] | None = None  # JSON keys are strings; pydantic reads them as ints
    response_format: ResponseFormat | None = None  # structured outputs (vLLM takes it on completions too)
    # vLLM's extensions
    top_k: int = Field(default=0, ge=-1)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)  # per prompt position: the token's and k more
    # pdserve's: the objective class this request is judged by (`router.request_objective`); None: by prompt length
    slo_class: str | None = None

    @field_validator("prompt_logprobs")
    @classmethod
    def _prompt_logprobs_not_streamed(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and info.data.get("stream"):  # ``stream`` is declared, so validated, first
            raise ValueError("prompt_logprobs are not available when stream=True")
        return v

    @field_validator("n", mode="before")
    @classmethod
    def _n_null_is_one(cls, v: Any) -> Any:
        return 1 if v is None else v  # ``"n": null``, as some clients send it: OpenAI's default

    @field_validator("logit_bias")
    @classmethod
    def _bias_range(cls, v: dict[int, float] | None) -> dict[int, float] | None:
        for tid, bias in (v or {}).items():
            if tid < 0:
                raise ValueError(f"token id {tid} is negative")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"bias {bias} of token {tid} is outside -100..100")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, v: list[int] | None) -> list[int] | None:
        if v and min(v) < 0:
            raise ValueError("token ids must be non-negative")
        return v

    @model_validator(mode="after")
    def _min_tokens_fit(self) -> GenerationRequest:
        limit = self.requested_max_tokens
        if limit is not None and self.min_tokens > limit:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be at most max_tokens ({limit})")
        return self

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > 4:
            raise ValueError("at most 4 stop sequences are allowed")
        return v

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        items = [self.stop] if isinstance(self.stop, str) else self.stop
        return tuple(s for s in items if s)

    @property
    def requested_max_tokens(self) -> int | None:
        """``max_completion_tokens`` wins over the older ``max_tokens`` when both are set."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(GenerationRequest):
    """``POST /v1/completions``: ``prompt`` is a string, a list of one string, or a list of token ids."""

    prompt: str | list[int] | list[str]
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool = False  # the prompt's text before the completion's (with logprobs: the prompt's tokens first)

    @property
    def prompt_logprobs_k(self) -> int | None:
        """Alternatives per prompt position to compute: ``prompt_logprobs``, else ``logprobs`` with
        ``echo`` (vLLM's rule), else None (none computed)."""
        if self.prompt_logprobs is not None:
            return self.prompt_logprobs
        return self.logprobs if self.echo else None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: str | list[int] | list[str]) -> str | list[int] | list[str]:
        if isinstance(v, str):
            texts: list[str] = [v]
        elif not v:
            raise ValueError("prompt must not be empty")
        elif isinstance(v[0], str):
            texts = [x for x in v if isinstance(x, str)]
            if len(v) != 1:
                raise ValueError("only one prompt per request is supported")
        else:
            if any(isinstance(x, int) and x < 0 for x in v):
                raise ValueError("token ids must be non-negative")
            texts = []
        if any(t == "" for t in texts):
            raise ValueError("prompt must not be empty")
        return v


class ChatCompletionRequest(GenerationRequest):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    # checked against each other and the model's template in router.tools
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        return self
