"""What crosses the prefill pool's boundary: requests in, results (token 0 + KV handle) out.

Invariants: every field is a plain typed value (these travel through Ray as pickles); a result with
``finished=True`` carries no handle (every choice ended at token 0: nothing to decode, the blocks
are already freed); a result for ``n`` choices carries ``n`` first tokens (`PrefillResult.choices`,
one for ``n == 1``, in index order), each sampled from the same logits with its choice's seed
(`engine.sampling.choices`); a result with a handle keeps its blocks in the worker's outbox until
the decode side pulls or releases them, or the lease ends.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.sampling.prompt_logprobs import PromptLogprobs
from engine.sampling.sampler import SamplingParams, TopLogprobs
from kv_transfer.handle import KVHandle


@dataclass(frozen=True)
class PrefillRequest:
    """A prompt to prefill. ``prompt_token_ids`` is already tokenized (the router owns the template)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    arrival_time: float = 0.0  # router's wall clock when the request arrived (for queue metrics)
    # the prompt's log-probs with this many alternatives per position (None: not computed); such a
    # request takes no prefix-cache hit (a cached prefix has no logits) but still publishes its blocks
    prompt_logprobs: int | None = None
    n: int = 1  # choices: the prompt is prefilled once, token 0 sampled once per choice

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")


@dataclass(frozen=True)
class PrefillTimings:
    """Seconds spent in each stage of one prefill (for metrics)."""

    queue_s: float = 0.0
    prefill_s: float = 0.0
    num_chunks: int = 1


@dataclass(frozen=True)
class FirstToken:
    """Token 0 of one choice."""

    token_id: int
    logprob: float | None
    top_logprobs: TopLogprobs = ()
    finish_reason: str | None = None  # "stop" | "length" when token 0 ends this choice


@dataclass(frozen=True)
class PrefillResult:
    """Token 0 of each choice (``choices[i]`` is choice ``i``'s) and where to pull the prompt's KV from."""

    request_id: str
    choices: tuple[FirstToken, ...]  # one per choice, in index order (one for n == 1)
    handle: KVHandle | None
    finished: bool = False  # token 0 ended the request, every choice (EOS, stop id, max_tokens == 1, grammar complete)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    timings: PrefillTimings = field(default_factory=PrefillTimings)
    prompt_logprobs: PromptLogprobs | None = None  # positions 1.. of the prompt, when the request asks

    def __post_init__(self) -> None:
        if not self.choices:
            raise ValueError(f"{self.request_id}: a prefill result carries token 0 of at least one choice")
