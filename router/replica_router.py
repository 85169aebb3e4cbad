"""Serve's hook into our routing policies: a custom `RequestRouter` and the stats it routes by.

Owns: `LoadAwareRequestRouter` (set as ``request_router_config.request_router_class`` on the prefill
and decode deployments, it runs inside every process that holds a handle to them, i.e. the HTTP
router replicas) and `with_routing_stats`, which gives a replica class the ``record_routing_stats``
method Serve polls (it returns the replica's own ``load()`` report).

How a request reaches a replica: Serve calls `choose_replicas` with the candidates its queue-length
cache deems available and the pending request (whose first argument is our `PrefillRequest` or
`DecodeRequest`). We build one `LoadReport` per candidate from its latest routing stats, correct it
with the tokens this process has chosen or sent there and not yet seen complete (stats are up to one
stats period old), ask the pure policy in `router.policy`, and return ranks: the choice alone, then
the rest by load. Serve then sends to the first rank that accepts (max_ongoing_requests), backing off
and retrying if none does.

Why choices are booked before Serve confirms them: Serve runs several routing tasks at once and
confirms a send (`on_request_routed`) only after the replica's accept round trip, so a burst of
requests would all be chosen against the same stale book and land on one replica. Each choice
therefore books its tokens on the chosen replica at once (a *tentative* entry); the confirmation
moves them to the replica that really took the request, and a tentative entry never confirmed (the
caller gave up) expires after `TENTATIVE_TTL_S`.

Why replicas that died are remembered: Serve drops a replica from its set when a call to it fails
because the actor died, but puts it back with the next replica-info update (routing stats arrive
every stats period) until its controller notices the death (a health check, seconds later). Until
then a policy would see an idle replica (its calls all ended) and send it the very continuations
that its death caused (`router.migration`). So a replica reported dead is never a candidate again
(replica ids are never reused), and its last load report is not published.

Why replicas whose stats stopped changing come last: a replica that hangs (stopped, deadlocked,
partitioned) still looks alive to Serve, and after its streams were moved away (`router.migration`)
it looks idle; Serve's own accept round trip to it never returns. Its routing stats stop changing
(every report carries its time, `router.loadboard.REPORTED_AT`), so a replica whose stats last
changed more than ``stale_after_s`` before the freshest candidate's is a candidate only when no other
is. Staleness is relative: when the controller itself falls behind (busy cores, a replica restarting)
every replica's stats freeze together and none is set aside. It is measured on this process's clock
(when the stats last changed here), never by comparing clocks across hosts.

Invariants: the policy functions stay pure; this class holds only the token book (a request counts
on at most one replica at a time: tentative from its choice, confirmed from its routing, gone exactly
once when it completes) and publishes every replica-info update to `router.loadboard` for
`/metrics` and `/ready`.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from decode_worker.types import DecodeRequest
from engine.load_report import LoadReport
from prefill_worker.types import PrefillRequest
from router import loadboard
from router.policy import AffinityParams, choose, rank_replicas

_PARAM_FIELDS = frozenset(f.name for f in dataclasses.fields(AffinityParams))  # the rest of Serve's kwargs are not ours

T = TypeVar("T")

TENTATIVE_TTL_S = 10.0  # a choice Serve has not confirmed by then is taken as abandoned


def request_tokens(pending_request: PendingRequest | None) -> Sequence[int] | None:
    """The prompt of a pending ``prefill``/``generate`` call; None for ``load``/``ready``/others."""
    if pending_request is None or not pending_request.args:
        return None
    first = pending_request.args[0]
    if isinstance(first, (PrefillRequest, DecodeRequest)):
        return first.prompt_token_ids
    return None


def request_weight(pending_request: PendingRequest, tokens: Sequence[int]) -> int:
    """The tokens a call books on its replica: the prompt once per sequence it runs (a decode call of
    ``n`` choices runs ``n``, as the decode replica's own load report counts them)."""
    first = pending_request.args[0]
    return len(tokens) * (len(first.choices) if isinstance(first, DecodeRequest) else 1)


class LoadAwareRequestRouter(RequestRouter):
    """Routes by `router.policy` over replica load reports (see the module docstring)."""

    def initialize_state(self, policy: str = "least_outstanding_tokens", stale_after_s: float = 5.0,
                         **params: Any) -> None:
        self._policy = policy
        self._stale_after_s = stale_after_s
        self._stats_seen: dict[str, tuple[Any, float]] = {}  # replica -> (its report's time, when that changed here)
        self._params = AffinityParams(**{k: v for k, v in params.items() if k in _PARAM_FIELDS})
        self._lock = threading.Lock()
        self._inflight: dict[str, tuple[str, int]] = {}  # internal request id -> (replica, tokens)
        self._inflight_tokens: dict[str, int] = {}  # replica -> tokens (tentative and confirmed)
        self._tentative: dict[str, float] = {}  # internal request id -> when chosen (not yet confirmed)
        self._dead: set[str] = set()  # replicas a call found dead, while Serve may still list them

    def _report(self, replica: RunningReplica) -> LoadReport:
        rid = replica.replica_id.unique_id
        report = loadboard.stats_to_report(rid, replica.routing_stats or {})
        with self._lock:
            local = self._inflight_tokens.get(rid, 0)
        if local > report.outstanding_tokens:
            # Our own choices are fresher than a stats poll; with one router process they are the truth.
            report = dataclasses.replace(report, outstanding_tokens=local)
        return report

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        candidate_replicas = [r for r in candidate_replicas if r.replica_id.unique_id not in self._dead]
        if not candidate_replicas:
            return []
        candidate_replicas = self._not_hung(candidate_replicas)
        tokens = request_tokens(pending_request)
        if tokens is not None and pending_request is not None:
            self._unbook(pending_request.metadata.internal_request_id)  # a retry re-chooses from scratch
        self._expire_tentative()
        reports = [self._report(r) for r in candidate_replicas]
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        first = choose(self._policy, tokens, reports, self._params)
        if tokens is not None and pending_request is not None:
            self._book(pending_request.metadata.internal_request_id, first, request_weight(pending_request, tokens),
                       tentative=True)
        return [[by_id[rid] for rid in rank] for rank in rank_replicas(first, reports)]

    def _not_hung(self, replicas: list[RunningReplica]) -> list[RunningReplica]:
        """The replicas whose stats changed within ``stale_after_s`` of the freshest one's (all if none;
        a replica not yet seen in an update counts as fresh)."""
        changed = {r.replica_id.unique_id: self._stats_seen[r.replica_id.unique_id][1]
                   for r in replicas if r.replica_id.unique_id in self._stats_seen}
        if not changed:
            return replicas
        newest = max(changed.values())
        fresh = [r for r in replicas
                 if newest - changed.get(r.replica_id.unique_id, newest) <= self._stale_after_s]
        return fresh or replicas

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        tokens = request_tokens(pending_request)
        if tokens is None:
            return
        iid = pending_request.metadata.internal_request_id
        self._unbook(iid)
        self._book(iid, replica_id.unique_id, request_weight(pending_request, tokens), tentative=False)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._unbook(internal_request_id)

    def booked_tokens(self) -> dict[str, int]:
        """Tokens this process has chosen or sent to each replica and not seen complete."""
        with self._lock:
            return dict(self._inflight_tokens)

    def _book(self, iid: str, rid: str, n: int, *, tentative: bool) -> None:
        with self._lock:
            self._inflight[iid] = (rid, n)
            self._inflight_tokens[rid] = self._inflight_tokens.get(rid, 0) + n
            if tentative:
                self._tentative[iid] = time.monotonic()

    def _unbook(self, iid: str) -> None:
        with self._lock:
            self._tentative.pop(iid, None)
            old = self._inflight.pop(iid, None)
            if old is not None:
                self._sub(*old)

    def _expire_tentative(self) -> None:
        cutoff = time.monotonic() - TENTATIVE_TTL_S
        with self._lock:
            for iid in [iid for iid, t in self._tentative.items() if t < cutoff]:
                del self._tentative[iid]
                old = self._inflight.pop(iid, None)
                if old is not None:
                    self._sub(*old)

    def _sub(self, rid: str, n: int) -> None:
        left = self._inflight_tokens.get(rid, 0) - n
        if left > 0:
            self._inflight_tokens[rid] = left
        else:
            self._inflight_tokens.pop(rid, None)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        self._dead.add(replica_id.unique_id)
        super().on_replica_actor_died(replica_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        listed = {r.replica_id.unique_id for r in replicas}
        self._dead &= listed  # the controller dropped the rest: nothing left to filter
        replicas = [r for r in replicas if r.replica_id.unique_id not in self._dead]
        now = time.monotonic()
        seen = {}
        for r in replicas:
            at = (r.routing_stats or {}).get(loadboard.REPORTED_AT)
            old = self._stats_seen.get(r.replica_id.unique_id)
            seen[r.replica_id.unique_id] = old if old is not None and old[0] == at else (at, now)
        self._stats_seen = seen
        super().update_replicas(replicas)
        loadboard.publish(
            self._deployment_id.name,
            {r.replica_id.unique_id: loadboard.stats_to_report(r.replica_id.unique_id, r.routing_stats or {})
             for r in replicas},
        )


def with_routing_stats(cls: type[T]) -> type[T]:
    """A subclass of a replica class whose ``record_routing_stats`` returns its ``load()`` report.

    The subclass is built at run time (so cloudpickle ships it by value, with the base class by
    reference); the base class must define ``async def load(self) -> LoadReport``.
    """

    async def record_routing_stats(self: Any) -> Mapping[str, Any]:
        return loadboard.report_to_stats(await self.load())

    namespace = {"record_routing_stats": record_routing_stats, "__doc__": cls.__doc__}
    return type(cls.__name__, (cls,), namespace)


def router_config_kwargs(policy: str, params: AffinityParams, stale_after_s: float = 5.0) -> dict[str, Any]:
    """``request_router_kwargs`` for `LoadAwareRequestRouter.initialize_state` (JSON-able values)."""
    return {"policy": policy, "stale_after_s": stale_after_s, **dataclasses.asdict(params)}


def serve_router_config(
    policy: str = "least_outstanding_tokens",
    params: AffinityParams | None = None,
    stats_period_s: float = 1.0,
) -> RequestRouterConfig:
    """The ``request_router_config`` that puts a deployment's handles on `LoadAwareRequestRouter`."""
    options: dict[str, Any] = {  # a dict: Ray types RequestRouterConfig's kwargs as dicts
        "request_router_class": LoadAwareRequestRouter,
        # stats this far behind the freshest replica's: it stopped answering the controller's polls
        "request_router_kwargs": router_config_kwargs(policy, params or AffinityParams(), max(5.0, 5 * stats_period_s)),
        "request_routing_stats_period_s": stats_period_s,
        "request_routing_stats_timeout_s": max(5.0, 3 * stats_period_s),
    }
    return RequestRouterConfig(**options)
