"""KV hand-off across real OS processes over gloo: two sources (prefill) and one destination (decode).

SmolLM2 layout (30 layers, 3 KV heads, head_dim 64, fp32, 16-token blocks): a 1,000-token prompt
is 63 blocks = 46 MB. Byte-exactness is checked by comparing sha256 of the gathered blocks on both
sides. The processes are shared by the module (spawning one costs seconds); the last test checks
that every outbox ended empty, so every handle here must end pulled, released or expired.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator

import pytest

from tests.support.kv_caches import SMOL
from tests.support.kv_procs import (
    SOURCE,
    GetStats,
    Offer,
    Offered,
    Outcome,
    Proc,
    PullAll,
    Release,
    SourceReport,
    dest_main,
    source_main,
)

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]
SOURCE_BLOCKS = 300
DEST_BLOCKS = 8 * 63 + 16


@pytest.fixture(scope="module")
def procs() -> Iterator[dict[str, Proc]]:
    started: dict[str, Proc] = {}
    try:
        # Spawn all three before waiting on any: their imports overlap.
        started["a"] = Proc(source_main, SMOL, SOURCE_BLOCKS, 1)
        started["b"] = Proc(source_main, SMOL, SOURCE_BLOCKS, 2)
        started["dest"] = Proc(dest_main, SMOL, DEST_BLOCKS)
        stalling = dataclasses.replace(SOURCE, transport="gloo-stall")
        started["doomed"] = Proc(source_main, SMOL, 70, 3, stalling)  # killed mid-transfer by a test
        for p in started.values():
            p.ready()
        yield started
    finally:
        for p in started.values():
            p.stop()


def offer(p: Proc, n_tokens: int, count: int = 1, lease_s: float | None = None) -> list[Offered]:
    out = p.call(Offer(n_tokens, count, lease_s))
    assert all(isinstance(o, Offered) for o in out)
    return list(out)


def pull(dest: Proc, offers: list[Offered], timeout_s: float = 60.0, **kw: object) -> list[Outcome]:
    out = dest.call(PullAll(tuple(o.handle for o in offers), **kw), timeout_s=timeout_s + 10)  # type: ignore[arg-type]
    return list(out)


def assert_identical(offers: list[Offered], outcomes: list[Outcome]) -> None:
    for o, r in zip(offers, outcomes, strict=True):
        assert r.error is None, f"{r.error}: {r.message}"
        assert r.digest == o.digest


def test_1000_token_smollm2_kv_is_byte_identical(procs: dict[str, Proc]) -> None:
    offers = offer(procs["a"], 1000)
    assert offers[0].handle.nbytes == 63 * 737_280
    assert_identical(offers, pull(procs["dest"], offers))


def test_8_concurrent_pulls_from_2_sources(procs: dict[str, Proc]) -> None:
    offers = offer(procs["a"], 1000, 4) + offer(procs["b"], 1000, 4)
    outcomes = pull(procs["dest"], offers)
    assert_identical(offers, outcomes)
    assert len({o.digest for o in offers}) == 8  # different data everywhere: no mix-ups possible


@pytest.mark.parametrize("change", [dict(block_size=32), dict(dtype="bfloat16")])
def test_mismatched_layout_is_refused_naming_the_field(procs: dict[str, Proc], change: dict[str, object]) -> None:
    offers = offer(procs["a"], 100)
    (r,) = pull(procs["dest"], offers, layout=dataclasses.replace(SMOL, **change))  # type: ignore[arg-type]
    assert r.error == "TransferRefused"
    assert next(iter(change)) in r.message
    assert procs["dest"].call(Release((offers[0].handle,))) == "released"


def test_wrong_secret_is_refused_and_the_source_keeps_serving(procs: dict[str, Proc]) -> None:
    offers = offer(procs["b"], 200)
    (r,) = pull(procs["dest"], offers, secret=b"wrong-secret-wrong-secret-wrong!")
    assert r.error == "AuthError", r
    assert_identical(offers, pull(procs["dest"], offers))  # same handle, right secret
    report = procs["b"].call(GetStats())
    assert report.stats.auth_failures == 1


def test_expired_handle_is_refused(procs: dict[str, Proc]) -> None:
    offers = offer(procs["a"], 50, lease_s=0.2)
    time.sleep(0.5)
    (r,) = pull(procs["dest"], offers)
    assert r.error == "TransferRefused" and "expired" in r.message


def test_killed_source_fails_the_pull_in_time_and_others_still_work(procs: dict[str, Proc]) -> None:
    doomed = procs["doomed"]
    try:
        (o,) = offer(doomed, 1000)
        procs["dest"].send(PullAll((o.handle,), timeout_s=10.0, transport="gloo-stall"))
        time.sleep(0.8)  # the source stalls for 3 s with half of the layers sent
        doomed.kill()
        (r,) = procs["dest"].recv(20)
        # the control channel's EOF or gloo itself, whichever is first; not the pull's 10 s timeout
        # (that would be TransferTimeout)
        assert r.error == "TransferError", r
    finally:
        doomed.stop()
    offers = offer(procs["a"], 1000)
    assert_identical(offers, pull(procs["dest"], offers))


def test_outboxes_are_empty_after_all(procs: dict[str, Proc]) -> None:
    for name in ("a", "b"):
        deadline = time.monotonic() + 5
        while True:
            report = procs[name].call(GetStats())
            assert isinstance(report, SourceReport)
            if report.leftovers is None or time.monotonic() > deadline:
                break
            time.sleep(0.1)  # an expired lease may await the next sweep
        assert report.leftovers is None, report.leftovers
        assert report.free_blocks == SOURCE_BLOCKS
        assert report.stats.outbox.pending == 0 and report.stats.outbox.blocks_held == 0
