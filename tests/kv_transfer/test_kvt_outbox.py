"""Outbox leases: each entry's blocks are freed exactly once, whatever the interleaving."""

from __future__ import annotations

import random
import threading
from collections import Counter

import pytest

from kv_transfer.errors import TransferRefused
from kv_transfer.outbox import Outbox


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class Freed:
    """free_fn that counts: any block freed twice fails the test."""

    def __init__(self) -> None:
        self.count: Counter[int] = Counter()
        self.lock = threading.Lock()

    def __call__(self, blocks: list[int]) -> None:
        with self.lock:
            self.count.update(blocks)

    def check_once(self, blocks: range | list[int]) -> None:
        assert all(self.count[b] == 1 for b in blocks), {b: self.count[b] for b in blocks if self.count[b] != 1}
        assert max(self.count.values(), default=0) <= 1


def make(lease: float = 30.0) -> tuple[Outbox, Freed, Clock]:
    freed, clock = Freed(), Clock()
    return Outbox(freed, default_lease_s=lease, clock=clock), freed, clock


def test_put_returns_expiry_and_counts() -> None:
    ob, _, clock = make()
    assert ob.put("a", [1, 2, 3], 40) == clock.t + 30
    assert ob.put("b", [4], 1, lease_s=5) == clock.t + 5
    assert ob.pending() == 2 and ob.num_blocks_held() == 4
    with pytest.raises(ValueError):
        ob.put("a", [9], 1)
    with pytest.raises(ValueError):
        ob.put("c", [], 1)
    with pytest.raises(ValueError):
        ob.put("c", [5, 5], 1)


def test_lease_expiry_frees_once() -> None:
    ob, freed, clock = make(lease=10)
    ob.put("a", [1, 2], 20)
    assert ob.expire() == []
    clock.t += 10
    assert ob.expire() == ["a"]
    assert ob.expire() == []
    freed.check_once([1, 2])
    assert not ob.release("a") and not ob.done("a")
    freed.check_once([1, 2])
    with pytest.raises(TransferRefused, match="expired"):
        ob.take_for_transfer("a")
    assert ob.stats().expired == 1
    ob.check_empty()


def test_take_of_an_expired_but_unswept_entry_frees_and_refuses() -> None:
    ob, freed, clock = make(lease=10)
    ob.put("a", [1], 1)
    clock.t += 11
    with pytest.raises(TransferRefused, match="expired"):
        ob.take_for_transfer("a")
    freed.check_once([1])
    assert ob.expire() == []


def test_in_flight_is_not_expired_mid_send() -> None:
    ob, freed, clock = make(lease=10)
    ob.put("a", [1, 2], 20)
    entry = ob.take_for_transfer("a")
    assert entry.block_ids == (1, 2) and entry.n_tokens == 20
    clock.t += 1000
    assert ob.expire() == []
    assert freed.count == Counter()
    with pytest.raises(TransferRefused, match="already being pulled"):
        ob.take_for_transfer("a")
    assert ob.done("a")
    freed.check_once([1, 2])
    with pytest.raises(TransferRefused, match="already pulled"):
        ob.take_for_transfer("a")


def test_requeue_puts_back_under_lease_or_frees_if_late() -> None:
    ob, freed, clock = make(lease=10)
    ob.put("a", [1], 1)
    ob.put("b", [2], 1)
    ob.take_for_transfer("a")
    ob.take_for_transfer("b")
    assert not ob.requeue("a")  # lease left: back to pending
    ob.take_for_transfer("a")  # a retry may take it again
    clock.t += 20
    assert ob.requeue("b")  # lease gone while in flight: freed now
    assert ob.requeue("a")
    freed.check_once([1, 2])
    ob.check_empty()


def test_release_while_in_flight_frees_when_transfer_ends() -> None:
    ob, freed, _ = make()
    ob.put("a", [1], 1)
    ob.put("b", [2], 1)
    ob.take_for_transfer("a")
    ob.take_for_transfer("b")
    assert not ob.release("a") and not ob.release("b")
    assert freed.count == Counter()
    assert ob.done("a")  # the data arrived anyway
    assert ob.requeue("b")  # the send failed: freed as released
    freed.check_once([1, 2])
    assert ob.stats().released == 1 and ob.stats().done == 1


def test_unknown_and_done_without_take() -> None:
    ob, freed, _ = make()
    with pytest.raises(TransferRefused, match="unknown"):
        ob.take_for_transfer("nope")
    ob.put("a", [1], 1)
    assert not ob.done("a")  # done needs an in-flight entry
    assert ob.release("a")
    freed.check_once([1])


def test_check_empty_names_holdouts() -> None:
    ob, _, _ = make()
    ob.put("holdout", [1], 1)
    with pytest.raises(AssertionError, match="holdout"):
        ob.check_empty()
    assert ob.release_all() == 1
    ob.check_empty()


def test_random_interleavings_free_exactly_once() -> None:
    rng = random.Random(7)
    for _ in range(200):
        ob, freed, clock = make(lease=5)
        ids = [f"t{i}" for i in range(6)]
        for i, tid in enumerate(ids):
            ob.put(tid, [10 * i, 10 * i + 1], 2)
        for _ in range(40):
            tid = rng.choice(ids)
            op = rng.choice(["take", "done", "release", "requeue", "expire", "tick"])
            if op == "take":
                try:
                    ob.take_for_transfer(tid)
                except TransferRefused:
                    pass
            elif op == "done":
                ob.done(tid)
            elif op == "release":
                ob.release(tid)
            elif op == "requeue":
                ob.requeue(tid)
            elif op == "expire":
                ob.expire()
            else:
                clock.t += rng.uniform(0, 3)
        for tid in ids:  # wind down: end every transfer, then let every lease lapse
            ob.requeue(tid)
        clock.t += 100
        ob.expire()
        ob.check_empty()
        freed.check_once([b for i in range(6) for b in (10 * i, 10 * i + 1)])
        s = ob.stats()
        assert s.done + s.released + s.expired == s.put == 6


def test_threads_racing_free_exactly_once() -> None:
    ob, freed, _ = make()
    n = 300
    for i in range(n):
        ob.put(f"t{i}", [i], 1)
    for i in range(0, n, 2):
        ob.take_for_transfer(f"t{i}")
    barrier = threading.Barrier(4)

    def worker(op: str) -> None:
        barrier.wait()
        for i in range(n):
            getattr(ob, op)(f"t{i}")

    threads = [threading.Thread(target=worker, args=(op,)) for op in ("done", "release", "requeue", "release")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    ob.release_all()
    for i in range(n):
        ob.requeue(f"t{i}")
    ob.check_empty()
    freed.check_once(range(n))
