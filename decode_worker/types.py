"""What crosses the decode pool's boundary: a request with its KV handle in, a token stream out.

Invariants: a stream is a sequence of `TokenEvent`s, each tagged with its choice's ``index``; of
each choice's events exactly the last has a ``finish_reason``, and the stream ends after every
choice's last event; ``finish_reason == "error"`` carries ``error`` text (and, where the caller can act on it, an
``error_code``) and the request's blocks are already freed when it is sent.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.sampling.prompt_logprobs import PromptLogprobs
from engine.sampling.sampler import SamplingParams, TopLogprobs
from kv_transfer.handle import KVHandle


@dataclass(frozen=True)
class DecodeChoice:
    """One choice of a request to decode: its index among the request's ``n`` (which picks its seed,
    `engine.sampling.choices`, and its sequence id in the decode worker) and, when a prefill replica
    built the KV, its token 0 from the prefill (prefilled on the decode replica: None).

    A continuation (the choice's decode replica went away mid-stream, `router.migration`) also
    carries ``decoded``, the tokens already sent after token 0: ``generated`` is every token the
    client has, and its last one is the token fed next. The sampler's step index, penalties,
    ``min_tokens``, grammar matcher and the remaining ``max_tokens`` all follow from ``generated``,
    so the choice continues exactly as if it had never moved."""

    index: int
    first_token_id: int | None = None
    decoded: tuple[int, ...] = ()  # a continuation: the tokens sent after token 0

    def __post_init__(self) -> None:
        if self.decoded and self.first_token_id is None:
            raise ValueError(f"choice {self.index}: decoded tokens follow a token 0, and it has none")

    @property
    def generated(self) -> tuple[int, ...]:
        """Every token sent for this choice so far, token 0 first (empty: none yet, colocated)."""
        return () if self.first_token_id is None else (self.first_token_id, *self.decoded)


@dataclass(frozen=True)
class DecodeRequest:
    """Continue a sequence whose prompt KV was built by a prefill replica (or build it here).

    ``choices`` lists each choice to decode, one for ``n == 1`` (the default: choice 0, no token 0).
    Prefilled remotely (the REMOTE path): each choice carries its token 0 from the prefill and
    ``handle`` says where the prompt's KV is. Prefilled on the decode replica (colocated, or the
    router's LOCAL path in a disaggregated cluster): no choice carries a token 0, ``handle`` is
    ``None``, and the worker prefills the prompt itself, then streams each choice's token 0 as its
    first event. The prompt's KV is pulled (or prefilled) once and forked into one sequence per
    further choice.

    A continuation is one choice alone that carries tokens already sent (`DecodeChoice.generated`):
    the KV it needs is ``kv_token_ids`` (the prompt and every sent token but the last), pulled from
    ``handle`` or, without one, prefilled here; its first event is the token after the last sent.

    Invariants: at least one choice; choice indices are distinct and >= 0; a choice that carries
    more than token 0 is alone.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    choices: tuple[DecodeChoice, ...] = (DecodeChoice(0),)
    handle: KVHandle | None = None
    arrival_time: float = 0.0
    prompt_logprobs: int | None = None  # prefilled here only: the prompt's log-probs, k alternatives each
    # the request's objectives, when the router has them (`router.request_objective`): when token 0 is
    # due (absolute, on the router's wall clock, as `PrefillRequest.ttft_deadline`: orders the prompts
    # prefilled here) and its class's TPOT objective (while it runs, caps what a step prefills beside it)
    ttft_deadline: float | None = None
    tpot_s: float | None = None

    def __post_init__(self) -> None:
        if not self.choices:
            raise ValueError(f"{self.request_id}: a decode request needs at least one choice")
        indices = [c.index for c in self.choices]
        if len(set(indices)) != len(indices) or any(i < 0 for i in indices):
            raise ValueError(f"{self.request_id}: choice indices must be distinct and >= 0, got {indices}")
        carried = [c.index for c in self.choices if c.decoded]
        if carried and len(self.choices) > 1:
            raise ValueError(f"{self.request_id}: a continuation is one choice alone; choices {carried} of "
                             f"{indices} carry sent tokens")
        if self.tpot_s is not None and not self.tpot_s > 0:
            raise ValueError(f"{self.request_id}: tpot_s must be positive, got {self.tpot_s}")
        if carried and self.prompt_logprobs is not None:
            raise ValueError("a continuation takes no prompt log-probs (token 0 already carried them)")

    @property
    def kv_token_ids(self) -> tuple[int, ...]:
        """The tokens whose KV the decode replica needs before its first step: the prompt, and for a
        continuation every token sent but the last (which is fed at that step)."""
        sent = self.choices[0].generated
        return self.prompt_token_ids + sent[:-1] if len(self.choices) == 1 and sent else self.prompt_token_ids


@dataclass(frozen=True)
class DecodeTimings:
    """Seconds in each decode-side stage of one request (sent with the last event)."""

    queue_s: float = 0.0  # waiting for blocks / a batch slot
    transfer_s: float = 0.0  # KV pull
    transfer_bytes: int = 0
    prefill_s: float = 0.0  # prefilled on the decode replica only
    decode_s: float = 0.0


#: ``TokenEvent.error_code`` of a stream that failed because its prompt KV could not be pulled
#: (source gone, lease expired, transfer failed): nothing was decoded, and the caller may prefill
#: the prompt again and resubmit with a fresh handle.
KV_LOST = "kv_lost"


@dataclass(frozen=True)
class TokenEvent:
    """One or more new tokens of one request: one per decode step, or all of those the consumer had
    not yet taken when it fell behind (`merge_events`)."""

    request_id: str
    token_ids: tuple[int, ...]
    index: int = 0  # the choice these tokens belong to
    logprobs: tuple[float, ...] | None = None
    top_logprobs: tuple[TopLogprobs, ...] | None = None  # one per token, when the request asks
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None
    error_code: str | None = None  # with "error": what failed, for callers that can recover (KV_LOST)
    timings: DecodeTimings | None = None  # on the last event
    prompt_logprobs: PromptLogprobs | None = None  # prefilled here, with token 0, when the request asks


def merge_events(events: list[TokenEvent]) -> TokenEvent:
    """Successive events of one choice of one request as one: tokens (and log-probs) in order, the
    last event's end. Log-probs (and top log-probs) survive only if every event carries them; prompt
    log-probs (on token 0's event alone) survive."""
    last = events[-1]
    lps = [ev.logprobs for ev in events]
    tops = [ev.top_logprobs for ev in events]
    return TokenEvent(
        request_id=last.request_id,
        index=last.index,
        token_ids=tuple(t for ev in events for t in ev.token_ids),
        logprobs=None if any(lp is None for lp in lps) else tuple(x for lp in lps if lp is not None for x in lp),
        top_logprobs=None if any(t is None for t in tops) else tuple(x for t in tops if t is not None for x in t),
        finish_reason=last.finish_reason,
        error=last.error,
        error_code=last.error_code,
        timings=last.timings,
        prompt_logprobs=next((ev.prompt_logprobs for ev in events if ev.prompt_logprobs is not None), None),
    )
