"""The decode step-time model and the per-step prefill token budget it implies.

Owns: `StepTimeModel`, a replica's engine step time as a linear function of what the step runs (the
sequences it decodes, the context they attend to, the prompt tokens it prefills beside them), and
`step_token_budget`, the most prompt tokens a decode replica may prefill in one step while every
running stream stays inside its TPOT objective.

Why linear: a decode step reads every weight once (the fixed part), then does per-sequence work
(sampling, a row of every matmul) and per-context-token work (reading KV); a prefill chunk in the same
step adds matmul rows per token. Over the sizes one replica runs, those terms dominate; the capacity
planner fits the coefficients to a measured profile (`cluster.planner.profile`), a decode replica
to its own measured steps (`engine.step_fit`), and the path decision (`router.path_policy`) and the
decode replica's local prefill budget read the same object, so all of them judge a step alike.
`PRIOR` is the model assumed of a replica that has no fit yet: deliberately slow (a CPU-sized step,
a costly prompt token), so that before any measurement the budget errs small and the decision errs
towards the prefill pool.

Why a budget per step, not per request: a stream's TPOT is the mean of its step times, so keeping
every step inside the tightest running objective (times a safety factor for the model's error) keeps
every stream inside its own whatever else the replica prefills later.

Invariants: coefficients are ≥ 0 and the fixed part > 0, so a step time is positive and never falls as
work is added; the budget is in ``[0, cap]``, 0 exactly when the running streams leave no headroom.
Pure: no clock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class StepTimeModel:
    """Seconds per engine step: ``base_s + per_seq_s * batch + per_context_token_s * context +
    per_prefill_token_s * prefill_tokens``."""

    base_s: float
    per_seq_s: float = 0.0
    per_context_token_s: float = 0.0
    per_prefill_token_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.base_s > 0:
            raise ValueError(f"base_s must be positive, got {self.base_s}")
        for name in ("per_seq_s", "per_context_token_s", "per_prefill_token_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    def step_s(self, batch: int, context_tokens: int, prefill_tokens: int = 0) -> float:
        """One step decoding ``batch`` sequences over ``context_tokens`` in all, plus ``prefill_tokens``."""
        if batch < 0 or context_tokens < 0 or prefill_tokens < 0:
            raise ValueError(f"step sizes must be >= 0, got {batch}, {context_tokens}, {prefill_tokens}")
        return (self.base_s + self.per_seq_s * batch + self.per_context_token_s * context_tokens
                + self.per_prefill_token_s * prefill_tokens)


#: the share of the tightest running TPOT objective a step may take (the rest: the model's error)
TPOT_SAFETY = 0.9


def step_token_budget(model: StepTimeModel, batch: int, context_tokens: int, tpot_s: float | None,
                      cap: int, safety: float = TPOT_SAFETY) -> int:
    """Prompt tokens one step may prefill beside ``batch`` running streams (``context_tokens`` in all)
    so that the step stays within ``safety * tpot_s``, the tightest TPOT objective among them.

    No running streams (``batch`` 0 or ``tpot_s`` None): nothing to protect, the cap. A model without a
    per-token cost: the cap while the decode step alone fits, else 0.
    """
    if cap < 0:
        raise ValueError(f"cap must be >= 0, got {cap}")
    if not 0 < safety <= 1:
        raise ValueError(f"safety must be in (0, 1], got {safety}")
    if batch == 0 or tpot_s is None:
        return cap
    if not tpot_s > 0:
        raise ValueError(f"tpot_s must be positive, got {tpot_s}")
    spare = safety * tpot_s - model.step_s(batch, context_tokens)
    if spare <= 0:
        return 0
    if model.per_prefill_token_s == 0:
        return cap
    return min(cap, math.floor(spare / model.per_prefill_token_s))


#: a replica's step before it has measured enough of its own (see the module docstring): 50 ms a step,
#: 2 ms a sequence, 1 µs a context token, 2 ms a prompt token
PRIOR = StepTimeModel(base_s=0.05, per_seq_s=0.002, per_context_token_s=1e-6, per_prefill_token_s=0.002)
