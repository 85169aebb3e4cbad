"""Routing policies as pure functions (no Ray)."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from cluster.config import ClusterConfig, ConfigError, Environment
from engine.load_report import LoadReport
from router.policy import (
    POLICIES,
    AffinityParams,
    choose,
    consistent_replica,
    least_outstanding_tokens,
    prefix_affinity,
    prefix_key,
    rank_replicas,
    register,
)

pytestmark = pytest.mark.timeout(30)


def rep(rid: str, tokens: int = 0, ready: bool = True, waiting: int = 0) -> LoadReport:
    return LoadReport(replica_id=rid, role="prefill", num_waiting=waiting, num_running=0,
                      outstanding_tokens=tokens, kv_blocks_free=10, kv_blocks_total=10, ready=ready)


def test_least_outstanding_picks_min_and_breaks_ties_by_requests_then_id() -> None:
    assert least_outstanding_tokens([rep("a", 30), rep("b", 10), rep("c", 20)]) == "b"
    assert least_outstanding_tokens([rep("b", 10, waiting=1), rep("a", 10, waiting=2)]) == "b"
    assert least_outstanding_tokens([rep("b", 10), rep("a", 10)]) == "a"


def test_unready_replicas_are_skipped_unless_none_is_ready() -> None:
    assert least_outstanding_tokens([rep("a", 0, ready=False), rep("b", 99)]) == "b"
    assert least_outstanding_tokens([rep("a", 5, ready=False), rep("b", 9, ready=False)]) == "a"
    with pytest.raises(ValueError):
        least_outstanding_tokens([])


def test_prefix_key_needs_a_full_block_and_uses_only_the_first_blocks() -> None:
    assert prefix_key(list(range(15)), 16, 4) is None
    shared = list(range(64))
    assert prefix_key([*shared, 1, 2, 3], 16, 4) == prefix_key(shared + [9] * 40, 16, 4)
    assert prefix_key(shared, 16, 4) != prefix_key([7, *shared[1:]], 16, 4)


def test_same_prefix_same_replica_and_stable_under_report_order() -> None:
    reports = [rep(f"r{i}") for i in range(5)]
    prompt = list(range(100))
    first = prefix_affinity(prompt, reports)
    for _ in range(10):
        random.shuffle(reports)
        assert prefix_affinity(prompt, reports) == first


def test_prefixes_spread_over_replicas() -> None:
    reports = [rep(f"r{i}") for i in range(4)]
    chosen = {prefix_affinity([seed] * 16 + list(range(48)), reports) for seed in range(200)}
    assert chosen == {"r0", "r1", "r2", "r3"}


def test_consistent_hashing_moves_only_the_removed_replicas_keys() -> None:
    ids = [f"r{i}" for i in range(5)]
    keys = [prefix_key([k] * 16, 16, 1) for k in range(300)]
    before = {k: consistent_replica(k, ids) for k in keys if k is not None}
    after = {k: consistent_replica(k, ids[:-1]) for k in before}
    moved = [k for k in before if before[k] != after[k]]
    assert all(before[k] == "r4" for k in moved)


def test_overloaded_affinity_target_falls_back_to_least_loaded() -> None:
    prompt = list(range(64))
    reports = [rep("a"), rep("b"), rep("c")]
    target = prefix_affinity(prompt, reports)
    params = AffinityParams(imbalance_ratio=2.0, imbalance_tokens=100)
    loaded = [rep(r.replica_id, 1000 if r.replica_id == target else 50) for r in reports]
    fallback = prefix_affinity(prompt, loaded, params)
    assert fallback != target
    assert fallback == least_outstanding_tokens(loaded)
    # within the bound (2 * 50 + 100 = 200) the affinity holds
    mild = [rep(r.replica_id, 190 if r.replica_id == target else 50) for r in reports]
    assert prefix_affinity(prompt, mild, params) == target


def test_short_prompt_and_unknown_policy() -> None:
    reports = [rep("a", 5), rep("b", 1)]
    assert prefix_affinity([1, 2, 3], reports) == "b"
    assert choose("prefix_affinity", None, reports) == "b"
    with pytest.raises(ValueError):
        choose("random", [1], reports)


def test_rank_replicas_puts_choice_first_then_rest_by_load() -> None:
    reports = [rep("a", 30), rep("b", 10), rep("c", 20)]
    assert rank_replicas("a", reports) == [["a"], ["b", "c"]]
    assert rank_replicas("a", [rep("a")]) == [["a"]]


def test_affinity_params_validate() -> None:
    with pytest.raises(ValueError):
        AffinityParams(block_size=0)
    with pytest.raises(ValueError):
        AffinityParams(imbalance_ratio=0.5)


def test_a_new_policy_is_one_function_and_one_registration() -> None:
    """Registered, it is a config choice and `choose` runs it; unknown names are refused by both."""

    @register("most_free_blocks")
    def most_free(prompt: Sequence[int] | None, reports: Sequence[LoadReport], params: AffinityParams) -> str:
        return max(reports, key=lambda r: (r.kv_blocks_free, r.replica_id)).replica_id

    try:
        reports = [rep("a"), LoadReport("b", "prefill", 0, 0, 99, 50, 50)]
        assert choose("most_free_blocks", [1, 2, 3], reports) == "b"
        cfg = ClusterConfig.from_args({"prefill": {"policy": "most_free_blocks"},
                                       "decode": {"policy": "most_free_blocks"}}, Environment())
        assert cfg.prefill.policy == "most_free_blocks" and cfg.decode_policy() == "most_free_blocks"
        with pytest.raises(ValueError, match="registered twice"):
            register("most_free_blocks")(most_free)
        with pytest.raises(ValueError, match="most_free_blocks"):  # the error lists the registered names
            choose("no_such_policy", None, reports)
        with pytest.raises(ConfigError, match="no_such_policy"):
            ClusterConfig.from_args({"prefill": {"policy": "no_such_policy"}}, Environment())
    finally:
        POLICIES.pop("most_free_blocks", None)
