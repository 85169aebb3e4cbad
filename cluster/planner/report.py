"""The capacity plan as text and JSON: what `pdserve plan` prints and writes.

Owns `table` (one line per rate: the best split and chunk size, its predicted attainment and goodput,
per class and per path, beside colocated and always-remote at the same budget) and `to_json` (the same,
plus the inputs, in a form a later run can be compared with). Both state the profile's source first:
a plan from a roofline estimate says so wherever it is read.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from cluster.planner.profile import FittedProfile
from cluster.planner.search import Candidate, RatePlan, max_rate_at


def _pct(c: Candidate | None) -> str:
    return "-" if c is None else f"{100 * c.result.attainment:5.1f}%"


def table(plans: Sequence[RatePlan], fp: FittedProfile, gpus: int, target: float = 0.9) -> str:
    p = fp.profile
    lines = [f"profile: {p.label} [{p.source}]; budget {gpus} GPUs = {gpus // p.gpus_per_replica} replicas",
             f"{'rate':>8}  {'best split':>11} {'chunk':>5}  {'attain':>7} {'goodput':>8}  "
             f"{'colocated':>9} {'remote':>7}  {'ttft p99':>8} {'tpot p99':>8}  per class / paths"]
    if plans and plans[0].scale > 1:
        sim = plans[0].best.shape
        lines.insert(1, f"(simulated as a slice of {sim.prefill_replicas + sim.decode_replicas} replicas at "
                        f"1/{plans[0].scale:g} of each rate; splits in steps of {plans[0].scale:g})")
    for plan in plans:
        b = plan.best
        r = b.result
        pre, dec = plan.split(b)
        classes = " ".join(f"{k} {a}/{n}" for k, (a, n) in r.by_class.items())
        paths = " ".join(f"{k} {n}" for k, n in sorted(r.by_path.items()))
        lines.append(f"{plan.rate:8.2f}  {pre:>4}P:{dec}D".ljust(22)
                     + f"{b.shape.chunk_tokens:>5}  {_pct(b):>7} {plan.goodput(b):8.2f}  {_pct(plan.colocated):>9} "
                     f"{_pct(plan.always_remote):>7}  {r.ttft_p99_s:8.3f} {r.tpot_p99_s:8.4f}  {classes}; {paths}")
    held = max_rate_at(plans, target)
    lines.append(f"highest planned rate at >= {target:.0%} attainment: "
                 + (f"{held:g} req/s" if held is not None else "none of the rates tried"))
    return "\n".join(lines)


def _candidate(plan: RatePlan, c: Candidate | None) -> dict[str, Any] | None:
    if c is None:
        return None
    s, r = c.shape, c.result
    pre, dec = plan.split(c)
    return {"prefill_replicas": pre, "decode_replicas": dec,
            "chunk_tokens": s.chunk_tokens, "conditional": s.conditional, "attainment": r.attainment,
            "goodput": plan.goodput(c), "requests_simulated": r.requests,
            "by_class": {k: {"attained": a, "requests": n} for k, (a, n) in r.by_class.items()},
            "by_path": r.by_path, "ttft_p50_s": r.ttft_p50_s, "ttft_p99_s": r.ttft_p99_s,
            "tpot_p50_s": r.tpot_p50_s, "tpot_p99_s": r.tpot_p99_s}


def to_json(plans: Sequence[RatePlan], fp: FittedProfile, gpus: int, target: float = 0.9) -> dict[str, Any]:
    p = fp.profile
    return {"profile": {"label": p.label, "source": p.source, "hardware": p.hardware, "model": p.model},
            "fitted": {"prefill": vars(fp.prefill), "decode_step": vars(fp.step)},
            "gpus": gpus, "replicas": gpus // p.gpus_per_replica, "target_attainment": target,
            "max_rate_at_target": max_rate_at(plans, target),
            "rates": [{"rate": x.rate, "simulations": x.simulations, "slice_scale": x.scale,
                       "best": _candidate(x, x.best), "colocated": _candidate(x, x.colocated),
                       "always_remote": _candidate(x, x.always_remote)} for x in plans]}
