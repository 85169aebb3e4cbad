"""What a simulation records of each request, and what it reports: `SimRequest` and `SimResult`.

Owns: `SimRequest` (one simulated request: its arrival, objective class, decode replica, path, the
prompt tokens still to prefill, first and last token times, tokens generated), `SimResult` (attainment,
goodput, per class and per path counts, TTFT and TPOT percentiles) and `summarize`, which judges the
requests that arrived after the warm-up with the code's own `router.objectives.attained`.

Invariants: a request counts as attained only when it finished every output token and met both its
class's objectives; one still unfinished counts as missed; percentiles are over finished requests.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from cluster.planner.workload import Arrival
from router.objectives import Objectives, SLOClass, attained, tpot
from router.path_policy import Path


@dataclass(eq=False)  # identity: queues remove by `is`
class SimRequest:
    rid: str
    a: Arrival
    cls: SLOClass
    decode: int
    path: Path = Path.REMOTE
    remaining: int = 0  # prompt tokens to prefill
    first: float = math.nan
    last: float = math.nan
    generated: int = 0
    running: bool = False  # on its decode replica's running list (its TPOT objective counted there)

    @property
    def deadline(self) -> float:
        return self.cls.ttft_deadline(self.a.t)


@dataclass(frozen=True)
class SimResult:
    requests: int  # measured: those that arrived after the warm-up
    attained: int
    duration_s: float  # from the end of the warm-up to the last arrival
    by_class: dict[str, tuple[int, int]]  # class → (attained, requests)
    by_path: dict[str, int]  # path → requests
    ttft_p50_s: float
    ttft_p99_s: float
    tpot_p50_s: float
    tpot_p99_s: float

    @property
    def attainment(self) -> float:
        return self.attained / self.requests if self.requests else 0.0

    @property
    def goodput(self) -> float:
        """Requests per second within both objectives."""
        return self.attained / self.duration_s if self.duration_s > 0 else 0.0


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return math.nan
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def summarize(reqs: Iterable[SimRequest], objectives: Objectives, start: float, last: float) -> SimResult:
    """The result over the requests that arrived at ``start`` or later (``last``: the last arrival)."""
    ok, measured, ttfts, tpots = 0, 0, [], []
    by_class: dict[str, list[int]] = {c.name: [0, 0] for c in objectives.classes}
    by_path: dict[str, int] = {}
    for r in reqs:
        if r.a.t < start:
            continue
        measured += 1
        done = r.generated >= r.a.output_tokens
        by_class[r.cls.name][1] += 1
        by_path[r.path.value] = by_path.get(r.path.value, 0) + 1
        if not done:
            continue
        ttft, tp = r.first - r.a.t, tpot(r.first, r.last, r.a.output_tokens)
        ttfts.append(ttft)
        if tp is not None:
            tpots.append(tp)
        if attained(ttft, tp, r.cls):
            ok += 1
            by_class[r.cls.name][0] += 1
    return SimResult(measured, ok, last - start, {k: (v[0], v[1]) for k, v in by_class.items()}, by_path,
                     _pct(ttfts, 0.5), _pct(ttfts, 0.99), _pct(tpots, 0.5), _pct(tpots, 0.99))
