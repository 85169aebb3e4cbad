"""What crosses the prefill pool's boundary: requests in, results (token 0 + KV handle) out.

Invariants: every field is a plain typed value (these travel through Ray as pickles); a result with
``finished=True`` carries no handle (nothing to decode, the blocks are already freed); a result with
a handle keeps its blocks in the worker's outbox until the decode side pulls or releases them, or
the lease ends.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.sampling import SamplingParams, TopLogprobs
from kv_transfer.handle import KVHandle


@dataclass(frozen=True)
class PrefillRequest:
    """A prompt to prefill. ``prompt_token_ids`` is already tokenized (the router owns the template)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    arrival_time: float = 0.0  # router's wall clock when the request arrived (for queue metrics)


@dataclass(frozen=True)
class PrefillTimings:
    """Seconds spent in each stage of one prefill (for metrics)."""

    queue_s: float = 0.0
    prefill_s: float = 0.0
    num_chunks: int = 1


@dataclass(frozen=True)
class PrefillResult:
    """Token 0 and where to pull the prompt's KV from."""

    request_id: str
    token_id: int
    logprob: float | None
    handle: KVHandle | None
    finished: bool = False  # token 0 ended the request (EOS, stop id, max_tokens == 1, grammar complete)
    finish_reason: str | None = None  # "stop" | "length" when finished
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    timings: PrefillTimings = field(default_factory=PrefillTimings)
    top_logprobs: TopLogprobs = ()  # token 0's most likely alternatives, when the request asks
