"""The router's per-request path in a disaggregated cluster (``router.prefill_path: auto``): the
`router.path_policy.decide` call, with its inputs read off the load board.

Owns: `PathChoice` (one per router replica: reads the board, keeps the prefill pool's measured rate,
decides, counts each decision in ``pdserve:path_decisions_total``), and the pure pieces it is made of,
`pick_decode`, `step_model_of` and `path_inputs`.

What the inputs are, and why:
- the decode replica: the one the decode policy (``least_outstanding_tokens``, the disaggregated
  default) would pick from the reports on the board. Serve's routing may send the call to another
  (the board is up to one stats period old, and other router replicas route too); that is
  acceptable because the decision only needs a replica *like* the one that runs it: the policy
  sends the call to a replica at most as loaded as the one judged, so the local estimate stays
  conservative, and a LOCAL request is correct on any decode replica (each prefills handle-less
  requests itself), only its timing depends on the choice;
- its load: running streams, their context, their tightest TPOT objective, the prompt tokens it
  still has to prefill, and its own step-time fit (`engine.load_report.LoadReport`); a replica
  without a fit is judged by the configured prior (``PathParams.step``); none reported yet: an idle
  replica;
- the prefill pool: its queue wait and rate (`router.load_estimates`), the rate measured between two
  board snapshots and kept until a newer window measures it (`PRIOR_PREFILL_RATE_TPS` before any); a
  pool not reported yet counts as idle;
- the request's class (`router.request_objective.objective_for`). Without objectives a request is
  judged against `NO_OBJECTIVE`, whose objectives are infinite: no estimate can miss it, so the rule
  reduces to length and cache (LOCAL when the uncached part is short or the cached share is high,
  REMOTE otherwise), and no running stream caps the local budget;
- what the decode replica holds of the prompt in its prefix cache: not known to the router (0), and
  the KV transfer's time: not estimated (0); both err towards REMOTE for long prompts.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence

from engine.load_report import LoadReport, snapshot
from engine.step_model import StepTimeModel
from router.load_estimates import pool_prefill_rate, prefill_wait_s
from router.metrics import RouterMetrics
from router.objectives import SLOClass
from router.path_policy import PathDecision, PathInputs, PathParams, decide

#: the prefill pool's prompt tokens per second assumed before two of its reports measure it
PRIOR_PREFILL_RATE_TPS = 1000.0

#: the class of a request when no objectives are configured (see the module docstring)
NO_OBJECTIVE = SLOClass("none", ttft_s=math.inf, tpot_s=math.inf)

Board = Callable[[str], Mapping[str, LoadReport]]


def pick_decode(reports: Sequence[LoadReport]) -> LoadReport | None:
    """The decode replica ``least_outstanding_tokens`` would pick: the ready one (any, when none is
    ready) with the fewest outstanding tokens, ties by replica id; None with no reports."""
    ready = [r for r in reports if r.ready] or list(reports)
    return min(ready, key=lambda r: (r.outstanding_tokens, r.replica_id), default=None)


def step_model_of(report: LoadReport | None, prior: StepTimeModel) -> StepTimeModel:
    """The replica's own step-time fit, else ``prior``."""
    if report is None or report.step_fit is None:
        return prior
    return StepTimeModel(*report.step_fit)


def path_inputs(prompt_tokens: int, cls: SLOClass, decode: LoadReport | None,
                prefill: Sequence[LoadReport], rate_tps: float) -> PathInputs:
    """`PathInputs` for one request from the chosen decode replica's report and the prefill pool's."""
    wait = prefill_wait_s(prefill, rate_tps) if prefill else 0.0
    if decode is None:
        return PathInputs(prompt_tokens, 0, cls, wait, rate_tps)
    return PathInputs(prompt_tokens, 0, cls, wait, rate_tps, running=decode.num_running,
                      context_tokens=decode.running_context_tokens, running_tpot_s=decode.running_tpot_s,
                      local_queue_tokens=decode.local_queue_tokens)


class PathChoice:
    """LOCAL or REMOTE per request, from the board of this router process (see the module docstring)."""

    def __init__(self, params: PathParams, prefill_deployment: str, decode_deployment: str,
                 metrics: RouterMetrics, board: Board = snapshot) -> None:
        self._params = params
        self._prefill = prefill_deployment
        self._decode = decode_deployment
        self._metrics = metrics
        self._board = board
        self._seen: dict[str, LoadReport] = {}  # the prefill pool's reports at the last decision
        self.rate_tps = PRIOR_PREFILL_RATE_TPS

    def choose(self, prompt_tokens: int, cls: SLOClass | None) -> PathDecision:
        """Decide one request's path (``cls`` None: no objectives) and count the decision."""
        prefill = dict(self._board(self._prefill))
        if (rate := pool_prefill_rate(self._seen, prefill)) is not None:
            self.rate_tps = rate
        self._seen = prefill
        decode = pick_decode(list(self._board(self._decode).values()))
        params = dataclasses.replace(self._params, step=step_model_of(decode, self._params.step))
        x = path_inputs(prompt_tokens, cls or NO_OBJECTIVE, decode, list(prefill.values()), self.rate_tps)
        decision = decide(x, params)
        self._metrics.record_decision(decision)
        return decision
