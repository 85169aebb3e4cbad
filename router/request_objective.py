"""One request's objective at the router: its class and TTFT deadline on arrival, its attainment at the end.

Owns: `RequestObjective` (the request's `SLOClass` and when its first token is due), `objective_for`
(from the prompt's length, the request's ``slo_class`` field and its arrival; a class the objectives
do not have, or any class when none are configured, is a 400 naming ``slo_class``) and
`record_attainment` (a finished request judged against its class's two objectives and counted in
``pdserve:slo_requests_total`` by class, path and outcome: `RouterMetrics.record_slo`).

Why the deadline is absolute, on the wall clock of ``arrival_time``: it travels to the prefill
replicas as ``PrefillRequest.ttft_deadline``, where requests from every router replica wait in one
queue and are ordered earliest deadline first (`engine.prefill_planner.grant_order`); a wall-clock
time means the same instant on every host, a monotonic one does not. Attainment is measured on the
router's own monotonic clock, as the TTFT and TPOT histograms are, so both agree.

Invariants: without objectives every request's objective is None, nothing travels and nothing is
judged; with objectives every request has exactly one class (`Objectives.classify`), and
``ttft_deadline == arrival_time + cls.ttft_s``. Pure but for the metrics counter it increments.
"""

from __future__ import annotations

from dataclasses import dataclass

from router.errors import APIError, bad_request
from router.metrics import RouterMetrics
from router.objectives import Objectives, SLOClass, attained, tpot
from router.path_policy import Path

#: the request field naming a class (`router.protocol.GenerationRequest.slo_class`)
FIELD = "slo_class"


@dataclass(frozen=True)
class RequestObjective:
    """A request's class, and when its first token is due (seconds, the wall clock of its arrival)."""

    cls: SLOClass
    ttft_deadline: float


def objective_for(objectives: Objectives, prompt_tokens: int, slo_class: str | None,
                  arrival_time: float) -> RequestObjective | None:
    """The class a request falls into (the one ``slo_class`` names, else by ``prompt_tokens``) and
    its TTFT deadline; None without objectives. Raises a 400 naming ``slo_class`` for a class that
    is not configured."""
    try:
        cls = objectives.classify(prompt_tokens, slo_class)
    except ValueError as e:
        raise _refused(str(e)) from None
    return None if cls is None else RequestObjective(cls, cls.ttft_deadline(arrival_time))


def record_attainment(metrics: RouterMetrics, objective: RequestObjective | None, path: Path,
                      arrival_s: float, first_token_s: float, last_token_s: float,
                      output_tokens: int) -> bool | None:
    """Judge a request that sent its first token (times on one clock: arrival at the router, first
    and last token sent; ``output_tokens``: the longest choice's, token 0 included) and count it;
    whether it met both objectives, None without objectives (nothing counted)."""
    if objective is None:
        return None
    if not arrival_s <= first_token_s <= last_token_s:
        raise ValueError(f"need arrival <= first token <= last token, got {arrival_s}, {first_token_s}, "
                         f"{last_token_s}")
    ttft_s = first_token_s - arrival_s
    tpot_s = tpot(first_token_s, last_token_s, output_tokens)
    metrics.record_slo(objective.cls, path, ttft_s, tpot_s)
    return attained(ttft_s, tpot_s, objective.cls)


def _refused(why: str) -> APIError:
    return bad_request(f"{FIELD}: {why}.", param=FIELD, code="invalid_value")
