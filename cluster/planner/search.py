"""The capacity planner's search: for each offered rate, the prefill : decode split and chunk size that
serve the most requests within their objectives on a replica budget.

Owns: `Candidate` (one split and chunk size with its simulated result), `RatePlan` (the best candidate
at one rate, beside the always-remote and colocated ones at the same budget, for comparison), `plan`
and `max_rate_at`.

How: the budget gives ``R`` replicas (``gpus // gpus_per_replica``). At each rate, the split is searched
first at the middle chunk size: every ``P`` in ``0..R-1`` when ``R`` is small, else a coarse grid
refined around its best (attainment over ``P`` has one broad peak: too few prefill replicas queue
long prompts, too few decode replicas run out of KV and TPOT); then every chunk size at the best split.
``P = 0`` is the colocated cluster. Ties go to the higher goodput, then the fewer prefill replicas.
The always-remote cluster (every prompt to the prefill pool, as without the path decision) is searched
over a coarser grid at the best chunk size, for comparison.
The arrivals are the same at every candidate of a rate (the spec's seed), so candidates differ only
by the cluster.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, ProcessPoolExecutor
from dataclasses import dataclass

from cluster.planner.profile import FittedProfile
from cluster.planner.simulator import Shape, SimResult, simulate
from cluster.planner.workload import Arrival, WorkloadSpec, arrivals
from router.objectives import Objectives

COARSE_POINTS = 9  # splits tried before refining, on budgets too large to try them all
REMOTE_POINTS = 4  # splits the always-remote comparison tries


@dataclass(frozen=True)
class Candidate:
    shape: Shape
    result: SimResult

    def key(self) -> tuple[float, float, int]:
        return (self.result.attainment, self.result.goodput, -self.shape.prefill_replicas)


@dataclass(frozen=True)
class RatePlan:
    rate: float  # offered to the whole cluster
    best: Candidate
    always_remote: Candidate | None  # every prompt remote, at its own best split (None: one replica)
    colocated: Candidate
    simulations: int
    scale: float = 1.0  # cluster replicas per simulated replica (a slice was simulated when > 1)

    def split(self, c: Candidate) -> tuple[int, int]:
        """The candidate's prefill and decode replicas in the whole cluster."""
        total = round((c.shape.prefill_replicas + c.shape.decode_replicas) * self.scale)
        p = round(c.shape.prefill_replicas * self.scale)
        return p, total - p

    def goodput(self, c: Candidate) -> float:
        """The whole cluster's requests per second within both objectives."""
        return c.result.goodput * self.scale


def _splits(replicas: int, points: int = COARSE_POINTS) -> list[int]:
    """Prefill replica counts to try: all of ``0..replicas-1``, or ``points`` of them evenly spread."""
    if replicas <= points + 2:
        return list(range(replicas))
    step = (replicas - 1) / (points - 1)
    return sorted({round(i * step) for i in range(points)})


def _simulate(task: tuple[FittedProfile, Shape, list[Arrival], Objectives]) -> SimResult:
    return simulate(*task)


def plan_rate(fp: FittedProfile, spec: WorkloadSpec, rate: float, replicas: int, chunks: Sequence[int],
              prefill_batch_tokens: int = 2048, executor: Executor | None = None) -> RatePlan:
    """The best split and chunk size at one rate on ``replicas`` replicas; each round of candidates
    runs on ``executor`` when given (the simulations are independent)."""
    if replicas < 1 or not chunks:
        raise ValueError(f"need >= 1 replica and >= 1 chunk size, got {replicas}, {list(chunks)}")
    obj = spec.built_objectives()
    reqs = arrivals(spec, rate)
    seen: dict[Shape, Candidate] = {}

    def shape(p: int, chunk: int, conditional: bool = True) -> Shape:
        return Shape(p, replicas - p, chunk, max(prefill_batch_tokens, chunk), conditional)

    def run(shapes: list[Shape]) -> list[Candidate]:
        new = [s for s in dict.fromkeys(shapes) if s not in seen]
        tasks = [(fp, s, reqs, obj) for s in new]
        results = executor.map(_simulate, tasks) if executor is not None else map(_simulate, tasks)
        seen.update((s, Candidate(s, r)) for s, r in zip(new, results, strict=True))
        return [seen[s] for s in shapes]

    mid = sorted(chunks)[len(chunks) // 2]
    best = max(run([shape(p, mid) for p in _splits(replicas)]), key=Candidate.key)
    if replicas > COARSE_POINTS + 2:  # refine between the coarse neighbours of the best
        width = max(1, round((replicas - 1) / (COARSE_POINTS - 1)))
        at = best.shape.prefill_replicas
        lo, hi = max(0, at - width), min(replicas - 1, at + width)
        best = max([best, *run([shape(p, mid) for p in range(lo, hi + 1, max(1, width // 3))])], key=Candidate.key)
    at = best.shape.prefill_replicas
    best = max([best, *run([shape(at, c) for c in chunks])], key=Candidate.key)
    # one round: colocated, and the always-remote cluster at its own best split (the coarser grid)
    chunk = best.shape.chunk_tokens
    colocated, *remotes = run([shape(0, chunk)] + [shape(p, chunk, False) for p in _splits(replicas, REMOTE_POINTS)
                                                   if p > 0])
    remote = max(remotes, key=Candidate.key) if remotes else None
    return RatePlan(rate, best, remote, colocated, len(seen))


def plan(fp: FittedProfile, spec: WorkloadSpec, rates: Sequence[float], gpus: int, chunks: Sequence[int],
         jobs: int = 1, slice_replicas: int | None = None,
         progress: Callable[[RatePlan], None] | None = None) -> list[RatePlan]:
    """`plan_rate` at every rate, for a budget of ``gpus`` devices, on ``jobs`` processes.

    ``slice_replicas``: simulate that many replicas at the matching share of each rate, the cluster
    taken as copies of the slice (the policies balance load across replicas alike, so a slice sees
    what each part of the cluster sees; it gives up the larger pool's smoothing, so it errs on the
    cautious side, and splits come in steps of ``replicas / slice_replicas``). A GPU cluster's token
    rate is what a simulation pays for per token; the slice keeps it to seconds.
    """
    replicas = gpus // fp.profile.gpus_per_replica
    if replicas < 1:
        raise ValueError(f"{gpus} GPUs hold no replica of {fp.profile.gpus_per_replica} GPUs")
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    if slice_replicas is not None and slice_replicas < 1:
        raise ValueError(f"slice_replicas must be >= 1, got {slice_replicas}")
    simulated = min(replicas, slice_replicas or replicas)
    scale = replicas / simulated
    out = []
    with ProcessPoolExecutor(jobs) if jobs > 1 else contextlib.nullcontext() as executor:
        for rate in rates:
            p = plan_rate(fp, spec, rate / scale, simulated, chunks, executor=executor)
            out.append(dataclasses.replace(p, rate=rate, scale=scale))
            if progress is not None:
                progress(out[-1])
    return out


def max_rate_at(plans: Sequence[RatePlan], attainment: float = 0.9) -> float | None:
    """The highest planned rate whose best candidate holds ``attainment``."""
    held = [p.rate for p in plans if p.best.result.attainment >= attainment]
    return max(held, default=None)
