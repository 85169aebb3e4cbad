"""A discrete-event simulation of one pdserve cluster serving a list of arrivals, on a fitted profile.

Owns: `Shape` (a cluster's prefill and decode replica counts and its chunking) and `simulate`, which
records each request as a `cluster.planner.outcome.SimRequest` and reports their `SimResult`. It
runs the code's own policies, imported, never restated: the decode replica choice
(`router.policy.choose` over `LoadReport`s built from the simulated state), the path decision
(`router.path_policy.decide`, estimates from `router.load_estimates`), the prefill order and the
local chunks (`engine.prefill_planner.grant_tokens` with TTFT deadlines) under the per-step budget
(`engine.step_model.step_token_budget`), and each decode replica's admission, growth and preemption
(`decode_worker.scheduler.DecodeScheduler` over a real `engine.block_pool.BlockPool`).

Life cycle of a simulated request: arrival → objective class (`Objectives.classify`) → decode replica
chosen → path decided. REMOTE: queued on the least loaded prefill replica, prefilled over forwards
(time from `PrefillTimeModel`), token 0 at the end of its last forward (TTFT), then queued on its
decode replica, admitted, KV transferred (`FittedProfile.transfer_s`), running. LOCAL: queued on the
decode replica, admitted, prefilled in budgeted chunks beside the running streams, token 0 at the end
of its last chunk's step, running. Every decode step's time is the step model's for what it ran.

Attainment is counted over the arrivals after the first ``warmup_fraction`` of the schedule (an
empty cluster at the start flatters it); requests still unfinished at the horizon count as missed.
What it leaves out (so a plan is an estimate): prefix caching (no cached tokens), the router's own
time, the prefill replicas' KV capacity and swap copies' time. Deterministic: the same inputs give
the same result.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from itertools import count

from cluster.planner.outcome import SimRequest, SimResult, summarize
from cluster.planner.profile import FittedProfile
from cluster.planner.workload import Arrival
from decode_worker.scheduler import DecodeScheduler, SchedulerConfig
from engine.block_pool import BlockPool
from engine.load_report import LoadReport
from engine.prefill_planner import grant_tokens
from engine.step_model import step_token_budget
from router.load_estimates import prefill_wait_s
from router.objectives import Objectives
from router.path_policy import Path, PathInputs, PathParams, decide
from router.policy import choose


@dataclass(frozen=True)
class Shape:
    prefill_replicas: int  # 0: colocated (every request prefilled on its decode replica)
    decode_replicas: int
    chunk_tokens: int = 512  # a prompt's most tokens per forward, in both pools
    prefill_batch_tokens: int = 2048  # a prefill forward's budget
    conditional: bool = True  # the path decision; False: every request remote (with a prefill pool)
    # local chunks held under the running streams' TPOT (`step_token_budget`); False: ``chunk_tokens``
    # a step whatever runs, oldest first (today's colocated worker, `decode.prefill_chunk_size`)
    tpot_budget: bool = True
    policy: str = "least_outstanding_tokens"  # both pools' routing policy (the simulation has no token ids)

    def __post_init__(self) -> None:
        if self.prefill_replicas < 0 or self.decode_replicas < 1 or self.chunk_tokens < 1:
            raise ValueError(f"need prefill_replicas >= 0, decode_replicas >= 1, chunk_tokens >= 1: {self}")


@dataclass
class _Prefill:
    jobs: list[SimRequest] = field(default_factory=list)
    queued: int = 0  # prompt tokens still to prefill over the jobs (the load report's outstanding tokens)
    busy: bool = False
    running: list[tuple[SimRequest, int]] = field(default_factory=list)


@dataclass
class _Decode:
    sched: DecodeScheduler
    local: list[SimRequest] = field(default_factory=list)  # admitted LOCAL requests still prefilling
    busy: bool = False
    context: int = 0  # tokens of every live request on it (the load report's outstanding tokens)
    live: int = 0
    tpot_classes: dict[float, int] = field(default_factory=dict)  # running TPOT objectives, counted
    step: tuple[list[SimRequest], list[tuple[SimRequest, int]]] = ([], [])  # what the current step runs


_idle_pools: dict[tuple[int, int], list[BlockPool]] = {}  # this process's empty pools, reused across runs


def _pool(num_blocks: int, block_size: int) -> BlockPool:
    """An empty pool: building one costs a Python object per block, which a GPU's tens of thousands
    of blocks make the larger part of a short run, so pools emptied by earlier runs are reused."""
    idle = _idle_pools.get((num_blocks, block_size))
    return idle.pop() if idle else BlockPool(num_blocks, block_size, enable_prefix_cache=False)


def _give_back(sched: DecodeScheduler, rids: list[str]) -> None:
    """End what is left of ``rids`` on ``sched`` (``finish`` ignores ids it does not hold) and keep its
    pool for reuse once it is whole again."""
    for rid in rids:
        sched.finish(rid)
    pool = sched.pool
    if pool.num_free_blocks == pool.num_blocks:
        _idle_pools.setdefault((pool.num_blocks, pool.block_size), []).append(pool)


class _Sim:
    def __init__(self, fp: FittedProfile, shape: Shape, objectives: Objectives) -> None:
        p = fp.profile
        self.fp, self.shape, self.obj = fp, shape, objectives
        self.params = PathParams(step=fp.step, max_chunk_tokens=shape.chunk_tokens)
        self.rate = fp.prefill.rate_tps(shape.prefill_batch_tokens)  # a queue fills every forward
        self.prefills = [_Prefill() for _ in range(shape.prefill_replicas)]
        cfg = SchedulerConfig(max_num_seqs=p.max_num_seqs, max_swap_blocks=4 * p.kv_blocks)
        self.decodes = [_Decode(DecodeScheduler(cfg, _pool(p.kv_blocks, p.block_size)))
                        for _ in range(shape.decode_replicas)]
        self.events: list[tuple[float, int, str, int, str]] = []
        self.seq = count()
        self.reqs: dict[str, SimRequest] = {}
        self.now = 0.0

    def at(self, t: float, kind: str, replica: int = 0, rid: str = "") -> None:
        heapq.heappush(self.events, (t, next(self.seq), kind, replica, rid))

    # ---- routing: the code's policies over reports of the simulated state ----
    def _decode_reports(self) -> list[LoadReport]:
        return [LoadReport(str(i), "decode", 0, d.live, d.context, d.sched.pool.num_free_blocks,
                           d.sched.pool.num_blocks) for i, d in enumerate(self.decodes)]

    def _prefill_reports(self) -> list[LoadReport]:
        return [LoadReport(str(i), "prefill", len(p.jobs), 0, p.queued, 1, 1)
                for i, p in enumerate(self.prefills)]

    def arrive(self, rid: str) -> None:
        r = self.reqs[rid]
        r.decode = int(choose(self.shape.policy, None, self._decode_reports()))
        d = self.decodes[r.decode]
        if not self.prefills:
            r.path = Path.LOCAL
        elif self.shape.conditional:
            reports = self._prefill_reports()
            x = PathInputs(prompt_tokens=r.a.prompt_tokens, cached_tokens=0, cls=r.cls,
                           prefill_wait_s=prefill_wait_s(reports, self.rate), prefill_rate_tps=self.rate,
                           transfer_s=self.fp.transfer_s(r.a.prompt_tokens), running=d.live,
                           context_tokens=d.context, running_tpot_s=min(d.tpot_classes, default=None),
                           local_queue_tokens=sum(j.remaining for j in d.local))
            r.path = decide(x, self.params).path
        r.remaining = r.a.prompt_tokens
        if r.path is Path.LOCAL:
            self._to_decode(r)
        else:
            i = int(choose(self.shape.policy, None, self._prefill_reports()))
            self.prefills[i].jobs.append(r)
            self.prefills[i].queued += r.remaining
            self._kick_prefill(i)

    # ---- prefill pool ----
    def _kick_prefill(self, i: int) -> None:
        p = self.prefills[i]
        if p.busy or not p.jobs:
            return
        grants = grant_tokens([j.remaining for j in p.jobs], self.shape.prefill_batch_tokens,
                              self.shape.chunk_tokens, [j.deadline for j in p.jobs])
        p.running = [(j, g) for j, g in zip(p.jobs, grants, strict=True) if g]
        p.busy = True
        self.at(self.now + self.fp.prefill.seconds(sum(grants)), "prefill_end", i)

    def prefill_end(self, i: int) -> None:
        p = self.prefills[i]
        for j, g in p.running:
            j.remaining -= g
            p.queued -= g
            if j.remaining == 0:
                p.jobs.remove(j)
                self._first_token(j)
                if j.generated < j.a.output_tokens:
                    self._to_decode(j)
        p.busy, p.running = False, []
        self._kick_prefill(i)

    # ---- decode pool ----
    def _first_token(self, r: SimRequest) -> None:
        r.first = r.last = self.now
        r.generated = 1

    def _to_decode(self, r: SimRequest) -> None:
        d = self.decodes[r.decode]
        d.sched.add(r.rid, r.a.prompt_tokens + (r.path is Path.REMOTE), r.a.t)
        d.context += r.a.prompt_tokens
        d.live += 1
        self._kick_decode(r.decode)

    def _running(self, d: _Decode, r: SimRequest) -> None:
        r.running = True
        d.tpot_classes[r.cls.tpot_s] = d.tpot_classes.get(r.cls.tpot_s, 0) + 1

    def _done(self, d: _Decode, r: SimRequest) -> None:
        """Off the replica's books (finished, or ended by its scheduler)."""
        d.sched.finish(r.rid)
        d.context -= r.a.prompt_tokens + max(0, r.generated - 1)  # what `_to_decode` and the steps added
        d.live -= 1
        if r.running:
            r.running = False
            n = d.tpot_classes[r.cls.tpot_s] - 1
            d.tpot_classes[r.cls.tpot_s] = n
            if n == 0:
                del d.tpot_classes[r.cls.tpot_s]

    def transfer_done(self, i: int, rid: str) -> None:
        d = self.decodes[i]
        d.sched.on_transfer_done(rid)
        self._running(d, self.reqs[rid])
        self._kick_decode(i)

    def _kick_decode(self, i: int) -> None:
        d = self.decodes[i]
        if d.busy:
            return
        out = d.sched.schedule()
        for s in out.failed:  # outgrew the pool: it ends unfinished (missed)
            self._done(d, self.reqs[s.seq_id])
        for s in out.admitted:
            r = self.reqs[s.seq_id]
            if r.path is Path.LOCAL:
                d.local.append(r)
            else:
                self.at(self.now + self.fp.transfer_s(r.a.prompt_tokens), "transfer_done", i, s.seq_id)
        batch = len(out.decode)
        ctx = sum(s.num_tokens for s in out.decode)
        grants: list[int] = []
        if d.local and self.shape.tpot_budget:
            budget = step_token_budget(self.fp.step, batch, ctx, min(d.tpot_classes, default=None),
                                       self.shape.chunk_tokens, self.params.tpot_safety)
            grants = grant_tokens([r.remaining for r in d.local], budget, self.shape.chunk_tokens,
                                  [r.deadline for r in d.local])
        elif d.local:
            grants = grant_tokens([r.remaining for r in d.local], self.shape.chunk_tokens, self.shape.chunk_tokens)
        if batch == 0 and not any(grants):
            return  # idle until a transfer, an arrival or a finished prefill wakes it
        reqs = self.reqs
        d.step = ([reqs[s.seq_id] for s in out.decode], [(r, g) for r, g in zip(d.local, grants, strict=True) if g])
        d.busy = True
        self.at(self.now + self.fp.step.step_s(batch, ctx, sum(grants)), "step_end", i)

    def step_end(self, i: int) -> None:
        d = self.decodes[i]
        decoded, chunks = d.step
        on_token = d.sched.on_token
        d.context += len(decoded)
        for r in decoded:
            on_token(r.rid)
            r.generated += 1
            if r.generated >= r.a.output_tokens:
                r.last = self.now
                self._done(d, r)
        for r, g in chunks:
            r.remaining -= g
            if r.remaining == 0:
                d.local.remove(r)
                self._first_token(r)
                d.sched.on_transfer_done(r.rid)
                self._running(d, r)
                if r.generated >= r.a.output_tokens:
                    self._done(d, r)
        d.busy = False
        self._kick_decode(i)

    def run(self, arrivals: list[Arrival], horizon_s: float) -> None:
        for n, a in enumerate(arrivals):
            rid = f"r{n}"
            cls = self.obj.classify(a.prompt_tokens)
            assert cls is not None  # the planner refuses a workload without objectives
            self.reqs[rid] = SimRequest(rid, a, cls, 0)
            self.at(a.t, "arrive", 0, rid)
        while self.events:
            t, _, kind, i, rid = heapq.heappop(self.events)
            if t > horizon_s:
                break
            self.now = t
            if kind == "arrive":
                self.arrive(rid)
            elif kind == "prefill_end":
                self.prefill_end(i)
            elif kind == "step_end":
                self.step_end(i)
            else:
                self.transfer_done(i, rid)


def simulate(fp: FittedProfile, shape: Shape, arrivals: list[Arrival], objectives: Objectives,
             warmup_fraction: float = 0.2) -> SimResult:
    """Serve ``arrivals`` on a cluster of ``shape``; attainment by ``objectives`` over the arrivals
    after the first ``warmup_fraction`` of the schedule."""
    if not objectives.enabled:
        raise ValueError("simulate needs objectives: attainment is judged against them")
    if not arrivals or not 0 <= warmup_fraction < 1:
        raise ValueError(f"need arrivals and 0 <= warmup_fraction < 1, got {len(arrivals)}, {warmup_fraction}")
    sim = _Sim(fp, shape, objectives)
    slack = max(c.ttft_s + c.tpot_s * max(a.output_tokens for a in arrivals) for c in objectives.classes)
    last = max(a.t for a in arrivals)
    sim.run(arrivals, last + 2 * slack)
    left = [r.rid for r in sim.reqs.values() if r.generated < r.a.output_tokens]
    for d in sim.decodes:
        _give_back(d.sched, left)
    first = min(a.t for a in arrivals)
    return summarize(sim.reqs.values(), objectives, first + warmup_fraction * (last - first), last)
