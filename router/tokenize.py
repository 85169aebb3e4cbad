"""``/tokenize`` and ``/detokenize`` in vLLM's request and response shapes.

Owns: the request / response models and `tokenize` / `detokenize`, which the app's endpoints call
after auth and `router.fields.account`.

``/tokenize`` takes either a completion-style body (``prompt``, ``add_special_tokens`` default true)
or a chat-style one (``messages``, ``add_generation_prompt`` default true; the served model's chat
template, exactly as ``/v1/chat/completions`` renders it), and answers ``{"count", "max_model_len",
"tokens", "token_strs"}`` (``token_strs`` only with ``return_token_strs``: each id's vocabulary
spelling). ``/detokenize`` takes ``{"tokens"}`` and answers ``{"prompt"}``, special tokens included.
``model`` is optional; when given it must be the served name.

Invariants: the chat ids are the ones a chat completion of the same messages would prefill; ids
given to ``/detokenize`` are inside the vocabulary (else a 400 naming ``tokens``).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator

from router.codec import TextCodec
from router.errors import bad_request
from router.messages import ChatMessage
from router.tools import check_history


class TokenizeCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    return_token_strs: bool | None = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[int]

    @field_validator("tokens")
    @classmethod
    def _non_negative(cls, v: list[int]) -> list[int]:
        if any(t < 0 for t in v):
            raise ValueError("token ids must be non-negative")
        return v


class DetokenizeResponse(BaseModel):
    prompt: str


def tokenize(req: TokenizeCompletionRequest | TokenizeChatRequest, codec: TextCodec,
             max_model_len: int) -> TokenizeResponse:
    if isinstance(req, TokenizeChatRequest):
        check_history(req.messages, codec)
        try:
            ids = codec.encode_chat([m.to_template() for m in req.messages], req.add_generation_prompt)
        except ValueError as e:  # the template refused the conversation
            raise bad_request(str(e), param="messages") from None
    else:
        ids = codec.encode(req.prompt, req.add_special_tokens)
    strs = codec.token_strs(ids) if req.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=max_model_len, tokens=ids, token_strs=strs)


def detokenize(req: DetokenizeRequest, codec: TextCodec) -> DetokenizeResponse:
    bad = next((t for t in req.tokens if t >= codec.vocab_size), None)
    if bad is not None:
        raise bad_request(f"token id {bad} is outside the vocabulary (size {codec.vocab_size})", param="tokens")
    return DetokenizeResponse(prompt=codec.decode(req.tokens))
