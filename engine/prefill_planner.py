"""Which prompt tokens go into the next prefill forward: the pure step planner both pools use.

Owns: `grant_tokens`, the split of one forward's token budget among the admitted prompts, and
`wants_more`, the admission bound (admit while the admitted jobs cannot fill the budget).
`prefill_worker.worker.PrefillWorker` admits jobs as KV blocks allow, in FIFO order (in `grant_order`'s
when its jobs carry TTFT deadlines), then asks for the grants (budget ``max_batch_tokens``, cap
``max_chunk_tokens``, the deadlines when there are any); a
`decode_worker.worker.DecodeWorker` asks for the grants of the prompts it prefills itself (colocated,
or LOCAL in a disaggregated cluster) that its scheduler admitted (cap ``prefill_chunk_size``, budget
the same or, disaggregated, the step's token budget, `decode_worker.step_budget`; or every prompt
whole), with their deadlines when there are any.

Why a chunk cap: a forward's time grows with its tokens, and token 0 of every prompt in it waits for
the whole forward. Without a cap a 2,000-token prompt takes the whole budget and every short prompt
behind it waits one long forward per long prompt queued (the interference benchmark's chat TTFT
shows it: docs/benchmarks-notes.md). With ``max_chunk_tokens`` a long prompt advances at most
that many tokens per forward and short prompts fill the rest of the budget, so they pass it between
its chunks.

Order of grants, without deadlines: the oldest job first (it always advances, so nothing starves
however many short prompts arrive), then the others shortest-remaining first (those that finish in
this forward get their token 0 now). With deadlines (each job's TTFT deadline: arrival + its class's
objective, `router.objectives`): earliest deadline first, ties shortest remaining first, then FIFO.
Each job gets at most ``min(remaining, max_chunk_tokens)``, until the budget is spent.

Why deadlines: age-first serves a chat prompt with a 0.5 s objective after a long prompt that has
6 s. Earliest-deadline-first is the order that meets every deadline whenever any order can on one
server running one job at a time (here several jobs share a forward under the cap: its natural
form); callers with deadlines admit waiting jobs in the same order. It still starves nobody: a job
arriving later than ``d - T`` (its class objective ``T``) has a deadline after ``d``, so the job due
at ``d`` waits at most for the finitely many that arrived before, then advances by a chunk every
forward.

Invariants: grants are ≥ 0, never exceed a job's remaining tokens or the cap, and sum to at most
the budget; with any job present and a budget ≥ 1 the first job in the order (the oldest, or the
earliest deadline) gets ≥ 1. Pure: no model, no pool, no clock.
"""

from __future__ import annotations

from collections.abc import Sequence


def grant_tokens(remaining: Sequence[int], budget: int, max_chunk_tokens: int,
                 deadlines: Sequence[float] | None = None) -> list[int]:
    """Tokens each admitted job (FIFO order, ``remaining`` prompt tokens each) prefills this step;
    ``deadlines`` (one per job): earliest-deadline-first instead of oldest-first."""
    if budget < 0 or max_chunk_tokens < 1:
        raise ValueError(f"budget must be >= 0 and max_chunk_tokens >= 1, got {budget}, {max_chunk_tokens}")
    if any(r < 0 for r in remaining):
        raise ValueError(f"remaining tokens must be >= 0, got {list(remaining)}")
    grants = [0] * len(remaining)
    for i in grant_order(remaining, deadlines):
        if budget <= 0:
            break
        grants[i] = min(remaining[i], max_chunk_tokens, budget)
        budget -= grants[i]
    return grants


def grant_order(remaining: Sequence[int], deadlines: Sequence[float] | None = None) -> list[int]:
    """The order in which jobs (FIFO indices) take the budget (the module docstring's rule)."""
    if deadlines is None:
        return ([0] if remaining else []) + sorted(range(1, len(remaining)), key=lambda i: (remaining[i], i))
    if len(deadlines) != len(remaining):
        raise ValueError(f"one deadline per job: {len(deadlines)} deadlines for {len(remaining)} jobs")
    return sorted(range(len(remaining)), key=lambda i: (deadlines[i], remaining[i], i))


def wants_more(remaining: Sequence[int], budget: int, max_chunk_tokens: int) -> bool:
    """Whether one more job should be admitted: the admitted ones cannot fill the budget this step."""
    return sum(min(r, max_chunk_tokens) for r in remaining) < budget
