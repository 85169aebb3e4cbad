"""The per-request path decision: prefill on the chosen decode replica (LOCAL) or in the prefill pool (REMOTE).

Owns: `PathInputs` (what the router knows when a request arrives: its prompt, what the decode replica
holds of it, both pools' load as estimated from their load reports, `router.load_estimates`),
`PathParams` (the knobs), `decide` and its typed answer `PathDecision` (the path, the `Reason`, the
`PathEstimates` behind it), which is what the router counts per decision and the capacity planner's
simulator (`cluster.planner.simulator`) calls for every simulated request.

Why conditional disaggregation (Splitwise's and Dynamo's idea): a remote prefill pays the prefill
pool's queue and a KV transfer; a short or mostly cached prompt costs the decode replica one small
chunk between two steps, which its running streams absorb when the chunk is held under the per-step
token budget (`engine.step_model.step_token_budget`). Long prompts stay remote: prefilling them
locally would take many budgeted steps, and that is the interference disaggregation removes.

The rule, in order (the first that applies):
1. the decode replica's running streams leave no headroom (budget 0): REMOTE, ``NO_HEADROOM``;
2. the local estimate misses the TTFT objective: REMOTE, ``LOCAL_TOO_SLOW``;
3. the uncached part is short (≤ ``short_prompt_tokens``): LOCAL, ``SHORT``;
4. at least ``min_cached_fraction`` of the prompt is cached there: LOCAL, ``CACHED``;
5. the remote estimate misses the TTFT objective (the pool is behind): LOCAL, ``POOL_BEHIND``;
6. otherwise REMOTE, ``REMOTE_MEETS``.
So LOCAL is chosen only when its own estimate meets the objective, and a long prompt goes local only
when the pool would miss it anyway.

Estimates: local TTFT = the budgeted steps for the prompt tokens queued on the replica plus this
prompt's uncached ones, each step as the step-time model says; remote TTFT = the pool's estimated
queue wait + the prompt at the pool's measured rate + the transfer. Pure and deterministic.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from engine.step_model import TPOT_SAFETY, StepTimeModel, step_token_budget
from router.objectives import SLOClass


class Path(enum.Enum):
    LOCAL = "local"  # prefilled on the decode replica, chunked under the per-step budget
    REMOTE = "remote"  # prefilled in the prefill pool, KV pulled by the decode replica


class Reason(enum.Enum):
    NO_HEADROOM = "no_headroom"
    LOCAL_TOO_SLOW = "local_too_slow"
    SHORT = "short"
    CACHED = "cached"
    POOL_BEHIND = "pool_behind"
    REMOTE_MEETS = "remote_meets"


@dataclass(frozen=True)
class PathInputs:
    """What the router knows of one request and the two candidates when it decides."""

    prompt_tokens: int
    cached_tokens: int  # the prompt's prefix already in the decode replica's KV cache
    cls: SLOClass  # the request's objectives
    prefill_wait_s: float  # the prefill pool's estimated queue wait (`load_estimates.prefill_wait_s`)
    prefill_rate_tps: float  # the prefill pool's prompt tokens per second (measured, else profiled)
    transfer_s: float = 0.0  # the estimated KV transfer of this prompt
    running: int = 0  # the decode replica's running streams
    context_tokens: int = 0  # their context, in all
    running_tpot_s: float | None = None  # the tightest TPOT objective among them (None: none running)
    local_queue_tokens: int = 0  # prompt tokens already waiting to prefill on the decode replica

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1 or not 0 <= self.cached_tokens <= self.prompt_tokens:
            raise ValueError(f"need 1 <= prompt_tokens and 0 <= cached_tokens <= prompt_tokens, got "
                             f"{self.prompt_tokens}, {self.cached_tokens}")
        if not self.prefill_rate_tps > 0:
            raise ValueError(f"prefill_rate_tps must be positive, got {self.prefill_rate_tps}")
        if min(self.prefill_wait_s, self.transfer_s, self.running, self.context_tokens,
               self.local_queue_tokens) < 0:
            raise ValueError("waits, transfers, streams, context and queued tokens must be >= 0")


@dataclass(frozen=True)
class PathParams:
    step: StepTimeModel  # the decode replica's step-time model
    max_chunk_tokens: int = 512  # the most prompt tokens one local step prefills
    short_prompt_tokens: int = 64  # uncached tokens at most this: a short prompt
    min_cached_fraction: float = 0.5  # cached share of the prompt from which LOCAL is preferred
    tpot_safety: float = TPOT_SAFETY  # a step may take this share of the tightest TPOT objective

    def __post_init__(self) -> None:
        if self.max_chunk_tokens < 1 or self.short_prompt_tokens < 0:
            raise ValueError("max_chunk_tokens must be >= 1 and short_prompt_tokens >= 0")
        if not 0 < self.min_cached_fraction <= 1:
            raise ValueError(f"min_cached_fraction must be in (0, 1], got {self.min_cached_fraction}")


@dataclass(frozen=True)
class PathEstimates:
    uncached_tokens: int  # what a local prefill computes (at least the last token: its logits)
    step_budget_tokens: int  # prompt tokens per local step
    local_ttft_s: float  # inf when the budget is 0
    remote_ttft_s: float


@dataclass(frozen=True)
class PathDecision:
    path: Path
    reason: Reason
    estimates: PathEstimates


def estimate(x: PathInputs, p: PathParams) -> PathEstimates:
    """Both TTFT estimates and the local step budget for ``x``."""
    uncached = max(1, x.prompt_tokens - x.cached_tokens)
    budget = step_token_budget(p.step, x.running, x.context_tokens, x.running_tpot_s, p.max_chunk_tokens,
                               p.tpot_safety)
    if budget == 0:
        local = math.inf
    else:
        work = x.local_queue_tokens + uncached
        steps = math.ceil(work / budget)
        local = steps * p.step.step_s(x.running, x.context_tokens, min(budget, work))
    remote = x.prefill_wait_s + x.prompt_tokens / x.prefill_rate_tps + x.transfer_s
    return PathEstimates(uncached, budget, local, remote)


def decide(x: PathInputs, p: PathParams) -> PathDecision:
    """The path for one request (the rule in the module docstring)."""
    e = estimate(x, p)
    ttft = x.cls.ttft_s
    if e.step_budget_tokens == 0:
        return PathDecision(Path.REMOTE, Reason.NO_HEADROOM, e)
    if e.local_ttft_s > ttft:
        return PathDecision(Path.REMOTE, Reason.LOCAL_TOO_SLOW, e)
    if e.uncached_tokens <= p.short_prompt_tokens:
        return PathDecision(Path.LOCAL, Reason.SHORT, e)
    if x.cached_tokens >= p.min_cached_fraction * x.prompt_tokens:
        return PathDecision(Path.LOCAL, Reason.CACHED, e)
    if e.remote_ttft_s > ttft:
        return PathDecision(Path.LOCAL, Reason.POOL_BEHIND, e)
    return PathDecision(Path.REMOTE, Reason.REMOTE_MEETS, e)
