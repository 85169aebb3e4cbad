"""Routing policies: pure functions from replica load reports (and a prompt) to a replica id.

Owns: `least_outstanding_tokens`, `prefix_affinity`, the registry `POLICIES` that the config's
choices come from (a new policy is one function plus ``@register(name)``), and the ranking helper
`rank_replicas` the Serve adapter (`router.replica_router`) turns into Serve's candidate ranks.

Invariants:
- every function is deterministic: the same reports and prompt give the same answer in every
  process (ties are broken by replica id; prefix keys use the engine's blake2b block-hash chain,
  never Python's salted ``hash()``);
- only ready replicas are chosen while any replica is ready; when none reports ready, all are
  candidates (a replica that has not reported yet is not thereby dead);
- an empty report list is a caller error (`ValueError`): Serve never asks with no replicas.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engine.block_pool import block_hashes
from engine.load_report import LoadReport


@dataclass(frozen=True)
class AffinityParams:
    """Knobs of `prefix_affinity`.

    ``max_prefix_blocks`` full blocks of the prompt form the affinity key (a shared system prompt is
    usually longer than this, so requests sharing it share the key). The chosen replica is abandoned
    for the least loaded one when its outstanding tokens exceed
    ``imbalance_ratio * least + imbalance_tokens``.
    """

    block_size: int = 16
    max_prefix_blocks: int = 4
    imbalance_ratio: float = 2.0
    imbalance_tokens: int = 2048

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.max_prefix_blocks < 1:
            raise ValueError("block_size and max_prefix_blocks must be >= 1")
        if self.imbalance_ratio < 1.0 or self.imbalance_tokens < 0:
            raise ValueError("imbalance_ratio must be >= 1 and imbalance_tokens >= 0")


def _candidates(reports: Sequence[LoadReport]) -> list[LoadReport]:
    if not reports:
        raise ValueError("no replicas to route to")
    ready = [r for r in reports if r.ready]
    return ready or list(reports)


def _load_key(report: LoadReport) -> tuple[int, int, str]:
    return (report.outstanding_tokens, report.num_waiting + report.num_running, report.replica_id)


def least_outstanding_tokens(reports: Sequence[LoadReport]) -> str:
    """The ready replica with the fewest outstanding tokens (then fewest requests, then id)."""
    return min(_candidates(reports), key=_load_key).replica_id


def prefix_key(prompt_token_ids: Sequence[int], block_size: int, max_prefix_blocks: int) -> int | None:
    """Chain hash of the prompt's first ``max_prefix_blocks`` full blocks; None if it has no full block."""
    hashes = block_hashes(prompt_token_ids[: block_size * max_prefix_blocks], block_size)
    return hashes[-1] if hashes else None


def _rendezvous_weight(key: int, replica_id: str) -> int:
    data = key.to_bytes(8, "little") + replica_id.encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def consistent_replica(key: int, replica_ids: Sequence[str]) -> str:
    """Rendezvous (highest-random-weight) hashing: adding or removing a replica moves only its keys."""
    if not replica_ids:
        raise ValueError("no replicas to route to")
    return max(replica_ids, key=lambda rid: (_rendezvous_weight(key, rid), rid))


def prefix_affinity(
    prompt_token_ids: Sequence[int],
    reports: Sequence[LoadReport],
    params: AffinityParams | None = None,
) -> str:
    """The replica the prompt's prefix hashes to, unless it is overloaded relative to the least loaded.

    Prompts shorter than one block have no prefix to share and go to the least loaded replica.
    """
    p = params or AffinityParams()
    candidates = _candidates(reports)
    least = min(candidates, key=_load_key)
    key = prefix_key(prompt_token_ids, p.block_size, p.max_prefix_blocks)
    if key is None:
        return least.replica_id
    by_id = {r.replica_id: r for r in candidates}
    chosen = by_id[consistent_replica(key, sorted(by_id))]
    bound = p.imbalance_ratio * least.outstanding_tokens + p.imbalance_tokens
    if chosen.outstanding_tokens > bound:
        return least.replica_id
    return chosen.replica_id


#: A routing policy: (the request's prompt tokens, or None for a call without one, the replicas'
#: reports, the affinity knobs) → the chosen replica id.
Policy = Callable[[Sequence[int] | None, Sequence[LoadReport], AffinityParams], str]

#: Every policy by its config name; `cluster.config` accepts exactly these names.
POLICIES: dict[str, Policy] = {}


def register(name: str) -> Callable[[Policy], Policy]:
    """Add a policy under ``name`` (a new policy is one function and this decorator)."""

    def add(fn: Policy) -> Policy:
        if name in POLICIES:
            raise ValueError(f"routing policy {name!r} is registered twice")
        POLICIES[name] = fn
        return fn

    return add


@register("least_outstanding_tokens")
def _least_outstanding(prompt: Sequence[int] | None, reports: Sequence[LoadReport], params: AffinityParams) -> str:
    return least_outstanding_tokens(reports)


@register("prefix_affinity")
def _prefix_affinity(prompt: Sequence[int] | None, reports: Sequence[LoadReport], params: AffinityParams) -> str:
    if prompt is None:  # e.g. load(): no prefix to follow
        return least_outstanding_tokens(reports)
    return prefix_affinity(prompt, reports, params)


def known_policy(name: str) -> str:
    """``name`` if it is a registered policy, else a `ValueError` naming the registered ones."""
    if name not in POLICIES:
        raise ValueError(f"unknown routing policy {name!r}; expected one of {sorted(POLICIES)}")
    return name


def choose(
    policy: str,
    prompt_token_ids: Sequence[int] | None,
    reports: Sequence[LoadReport],
    params: AffinityParams | None = None,
) -> str:
    """Dispatch by policy name (`POLICIES`, checked by `known_policy`)."""
    return POLICIES[known_policy(policy)](prompt_token_ids, reports, params or AffinityParams())


def rank_replicas(first: str, reports: Sequence[LoadReport]) -> list[list[str]]:
    """Serve-style ranks: the chosen replica alone, then every other one from least to most loaded.

    Serve tries rank by rank, so a chosen replica whose Serve queue is full still leaves a fallback.
    """
    rest = sorted((r for r in reports if r.replica_id != first), key=_load_key)
    ranks = [[first]]
    if rest:
        ranks.append([r.replica_id for r in rest])
    return ranks
