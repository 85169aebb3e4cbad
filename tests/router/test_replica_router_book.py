"""`LoadAwareRequestRouter`'s token book, driven the way Serve drives it (no Ray cluster).

Serve runs several routing tasks at once and confirms each send only after the replica's accept
round trip; these tests replay that order with stand-in replicas and pending requests.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from engine.sampling.sampler import SamplingParams
from prefill_worker.types import PrefillRequest
from router import loadboard, replica_router
from router.replica_router import LoadAwareRequestRouter

pytestmark = pytest.mark.timeout(30)


def make_router(policy: str = "least_outstanding_tokens") -> LoadAwareRequestRouter:
    router = LoadAwareRequestRouter.__new__(LoadAwareRequestRouter)  # skip Serve's handle plumbing
    router.initialize_state(policy=policy)
    return router


def replica(name: str, outstanding: int = 0) -> Any:
    return SimpleNamespace(replica_id=rid(name),
                           routing_stats={"outstanding_tokens": outstanding})


def pending(iid: str, n_tokens: int = 100) -> Any:
    req = PrefillRequest(request_id=iid, prompt_token_ids=tuple(range(n_tokens)), sampling=SamplingParams())
    return SimpleNamespace(args=(req,), metadata=SimpleNamespace(internal_request_id=iid))


def rid(name: str) -> Any:  # stands in for Serve's ReplicaID (only .unique_id is read)
    return SimpleNamespace(unique_id=name)


def choose(router: LoadAwareRequestRouter, replicas: list[Any], req: Any) -> str:
    ranks = asyncio.run(router.choose_replicas(replicas, req))
    return str(ranks[0][0].replica_id.unique_id)


def test_burst_chosen_before_any_confirmation_spreads_over_replicas() -> None:
    """8 concurrent choices against idle stale stats: 4 on each replica, not 8 on the first."""
    router, reps = make_router(), [replica("a"), replica("b")]
    chosen = [choose(router, reps, pending(f"r{i}")) for i in range(8)]  # no on_request_routed yet
    assert sorted(chosen) == ["a"] * 4 + ["b"] * 4
    assert router.booked_tokens() == {"a": 400, "b": 400}


def test_confirmation_moves_the_booking_to_the_replica_that_took_it() -> None:
    router, reps = make_router(), [replica("a"), replica("b")]
    req = pending("r0")
    assert choose(router, reps, req) == "a"
    router.on_request_routed(req, rid("b"), None)  # "a" refused, fallback rank took it
    assert router.booked_tokens() == {"b": 100}
    router.on_request_completed(rid("b"), "r0")
    assert router.booked_tokens() == {}
    router.on_request_completed(rid("b"), "r0")  # a second completion is a no-op
    assert router.booked_tokens() == {}


def test_a_decode_call_of_n_choices_books_the_prompt_per_choice() -> None:
    from decode_worker.types import DecodeChoice, DecodeRequest

    router, reps = make_router(), [replica("a"), replica("b")]
    req = DecodeRequest("r0", tuple(range(100)), SamplingParams(),
                        choices=tuple(DecodeChoice(i) for i in range(3)))
    call = SimpleNamespace(args=(req,), metadata=SimpleNamespace(internal_request_id="r0"))
    assert choose(router, reps, call) == "a"
    router.on_request_routed(call, rid("a"), None)
    assert router.booked_tokens() == {"a": 300}  # 3 sequences, as the replica's own report counts them


def test_a_retried_choice_counts_once() -> None:
    router, reps = make_router(), [replica("a"), replica("b", outstanding=50)]
    req = pending("r0")
    for _ in range(5):  # Serve's backoff loop asks again for the same request
        choose(router, reps, req)
    assert sum(router.booked_tokens().values()) == 100


def test_unconfirmed_choices_expire(monkeypatch: pytest.MonkeyPatch) -> None:
    router, reps = make_router(), [replica("a"), replica("b")]
    now = [1000.0]
    monkeypatch.setattr(replica_router.time, "monotonic", lambda: now[0])
    kept, dropped = pending("kept"), pending("dropped")
    choose(router, reps, kept)
    choose(router, reps, dropped)
    router.on_request_routed(kept, rid("a"), None)
    now[0] += replica_router.TENTATIVE_TTL_S + 1
    choose(router, reps, pending("later", 7))  # the sweep runs on each choice
    booked = router.booked_tokens()
    assert booked.get("a", 0) + booked.get("b", 0) == 107  # the confirmed one stays, the abandoned one is gone


def test_fresher_stats_win_over_a_smaller_book() -> None:
    """A replica reporting more outstanding tokens than we booked (other routers' load) is avoided."""
    router = make_router()
    reps = [replica("a", outstanding=1000), replica("b")]
    assert [choose(router, reps, pending(f"r{i}")) for i in range(3)] == ["b", "b", "b"]


def test_a_replica_found_dead_is_never_chosen_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """Serve lists a dead replica again (with its idle stats) until its controller notices the death:
    the continuations its death caused must not go back to it, whatever the policy."""
    monkeypatch.setattr(replica_router.RequestRouter, "on_replica_actor_died", lambda self, r: None)
    for policy in ("least_outstanding_tokens", "prefix_affinity"):
        router = make_router(policy)
        reps = [replica("a"), replica("b", outstanding=10_000)]  # the dead one looks idle
        req = pending("r0")
        assert choose(router, reps, req) == "a"
        router.on_replica_actor_died(rid("a"))
        assert [choose(router, reps, pending(f"r{i}")) for i in range(1, 4)] == ["b"] * 3
        assert asyncio.run(router.choose_replicas([replica("a")], pending("r9"))) == []


def test_a_replica_whose_stats_stopped_changing_comes_last(monkeypatch: pytest.MonkeyPatch) -> None:
    """A hung replica (its stats unchanged past ``stale_after_s``, on this process's clock) is chosen
    only when no other replica is left, however idle it looks."""
    monkeypatch.setattr(replica_router.RequestRouter, "update_replicas", lambda self, r: None)
    now = [100.0]
    monkeypatch.setattr(replica_router.time, "monotonic", lambda: now[0])
    router = LoadAwareRequestRouter.__new__(LoadAwareRequestRouter)
    router.initialize_state(policy="least_outstanding_tokens", stale_after_s=2.0)
    router._deployment_id = SimpleNamespace(name="test-stale-decode")  # Serve's, for the load board

    def stats(name: str, at: float, outstanding: int) -> Any:
        return SimpleNamespace(replica_id=rid(name), routing_stats={"outstanding_tokens": outstanding,
                                                                     loadboard.REPORTED_AT: at})

    router.update_replicas([stats("hung", 1.0, 0), stats("busy", 1.0, 5_000)])
    assert choose(router, [stats("hung", 1.0, 0), stats("busy", 1.0, 5_000)], pending("r0")) == "hung"
    now[0] += 3.0  # the controller's polls of "hung" stopped answering; "busy" reports on
    reps = [stats("hung", 1.0, 0), stats("busy", 4.0, 5_000)]
    router.update_replicas(reps)
    assert [choose(router, reps, pending(f"r{i}")) for i in range(1, 4)] == ["busy"] * 3
    assert choose(router, reps[:1], pending("r9")) == "hung"  # the last resort is still a resort


def test_stats_frozen_everywhere_set_no_replica_aside(monkeypatch: pytest.MonkeyPatch) -> None:
    """When every replica's stats stop changing together (the controller fell behind, not a replica),
    staleness is relative: none is set aside, and the burst still spreads by load."""
    monkeypatch.setattr(replica_router.RequestRouter, "update_replicas", lambda self, r: None)
    now = [100.0]
    monkeypatch.setattr(replica_router.time, "monotonic", lambda: now[0])
    router = LoadAwareRequestRouter.__new__(LoadAwareRequestRouter)
    router.initialize_state(policy="least_outstanding_tokens", stale_after_s=2.0)
    router._deployment_id = SimpleNamespace(name="test-frozen-decode")

    reps = [SimpleNamespace(replica_id=rid(n), routing_stats={"outstanding_tokens": 0, loadboard.REPORTED_AT: 1.0})
            for n in ("a", "b")]
    router.update_replicas(reps)
    now[0] += 30.0  # no update for 30 s
    chosen = [choose(router, reps, pending(f"r{i}")) for i in range(4)]
    assert sorted(chosen) == ["a", "a", "b", "b"], chosen
