"""`router.path_choice` over synthetic load boards (pure, no Ray), and `Generation` taking the path it
decides over in-process stand-ins for Serve handles.

Oracles: `router.path_policy.decide` on inputs built by hand from the same reports (the choice adds
only the reading of the board), `router.load_estimates` for the measured prefill rate, the fakes'
known completion (`tests.support.pd_fakes`) for the text, which must not depend on the path, and the
handles' call books for where the prompt was prefilled."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

import pytest

from engine.load_report import LoadReport
from engine.sampling.sampler import SamplingParams
from engine.step_model import PRIOR, StepTimeModel
from router.backends import Backends
from router.generation import Generation, GenerationInput
from router.metrics import RouterMetrics
from router.objectives import Objectives, SLOClass
from router.path_choice import NO_OBJECTIVE, PRIOR_PREFILL_RATE_TPS, PathChoice, path_inputs, pick_decode, step_model_of
from router.path_policy import Path, PathInputs, PathParams, Reason, decide
from router.request_objective import objective_for
from tests.support.fake_handles import FakeHandle
from tests.support.pd_fakes import FailingDecode, FakeCodec, FakePrefill, expected_text

pytestmark = pytest.mark.timeout(30)

PARAMS = PathParams(step=PRIOR, max_chunk_tokens=256, short_prompt_tokens=64)
FIT = (0.01, 0.001, 1e-6, 1e-4)  # a decode replica's own step fit: 10 ms, 1 ms a sequence, 0.1 ms a prompt token
CHAT = SLOClass("chat", ttft_s=0.5, tpot_s=0.05)


def decode(rid: str, outstanding: int = 0, ready: bool = True, **kw: object) -> LoadReport:
    return LoadReport(replica_id=rid, role="decode", num_waiting=0, num_running=kw.pop("num_running", 0),  # type: ignore[arg-type]
                      outstanding_tokens=outstanding, kv_blocks_free=10, kv_blocks_total=10, ready=ready, **kw)  # type: ignore[arg-type]


def prefill(rid: str, outstanding: int = 0, tokens: int = 0, seconds: float = 0.0) -> LoadReport:
    return LoadReport(replica_id=rid, role="prefill", num_waiting=0, num_running=0, outstanding_tokens=outstanding,
                      kv_blocks_free=10, kv_blocks_total=10, prefill_tokens=tokens, prefill_seconds=seconds)


class Board:
    """A load board whose snapshots a test sets."""

    def __init__(self) -> None:
        self.reports: dict[str, dict[str, LoadReport]] = {"prefill": {}, "decode": {}}

    def set(self, deployment: str, *reports: LoadReport) -> None:
        self.reports[deployment] = {r.replica_id: r for r in reports}

    def __call__(self, deployment: str) -> Mapping[str, LoadReport]:
        return self.reports[deployment]


def decisions(metrics: RouterMetrics, path: Path, reason: Reason) -> float:
    return metrics.registry.get_sample_value("pdserve:path_decisions_total",
                                             {"path": path.value, "reason": reason.value}) or 0.0


def test_pick_decode_is_least_outstanding_tokens_among_the_ready() -> None:
    a, b, c = decode("a", 300), decode("b", 100), decode("c", 10, ready=False)
    assert pick_decode([a, b, c]) is b
    assert pick_decode([c, decode("d", 10, ready=False)]) is c  # none ready: all of them, ties by id
    assert pick_decode([decode("y", 5), decode("x", 5)]).replica_id == "x"  # type: ignore[union-attr]
    assert pick_decode([]) is None


def test_the_step_model_is_the_replicas_fit_else_the_prior() -> None:
    assert step_model_of(None, PRIOR) is PRIOR
    assert step_model_of(decode("a"), PRIOR) is PRIOR
    assert step_model_of(decode("a", step_fit=FIT), PRIOR) == StepTimeModel(*FIT)


def test_inputs_carry_the_chosen_replicas_load_and_the_pools_wait() -> None:
    d = decode("a", 900, num_running=3, running_context_tokens=800, running_tpot_s=0.1, local_queue_tokens=40)
    x = path_inputs(50, CHAT, d, [prefill("p", outstanding=2000), prefill("q", outstanding=500)], 1000.0)
    assert x == PathInputs(50, 0, CHAT, 0.5, 1000.0, running=3, context_tokens=800, running_tpot_s=0.1,
                           local_queue_tokens=40)
    idle = path_inputs(50, CHAT, None, [], 1000.0)  # nothing reported yet: both pools idle
    assert idle == PathInputs(50, 0, CHAT, 0.0, 1000.0)


def test_without_objectives_the_path_is_by_length() -> None:
    board, metrics = Board(), RouterMetrics()
    board.set("decode", decode("a", num_running=4, running_context_tokens=4000, running_tpot_s=None))
    choice = PathChoice(PARAMS, "prefill", "decode", metrics, board)
    assert choice.choose(64, None).path is Path.LOCAL
    assert choice.choose(65, None).path is Path.REMOTE
    assert choice.choose(5000, None).path is Path.REMOTE  # no objective to miss: never POOL_BEHIND
    assert decisions(metrics, Path.LOCAL, Reason.SHORT) == 1
    assert decisions(metrics, Path.REMOTE, Reason.REMOTE_MEETS) == 2


def test_decisions_equal_the_policy_on_the_boards_inputs() -> None:
    """Busy replicas, a backed-up pool, a tight objective: each decision is `decide` on what the board says
    of the replica the decode policy would pick, judged by that replica's own fit."""
    board, metrics = Board(), RouterMetrics()
    busy = decode("busy", 5000, num_running=30, running_context_tokens=5000, running_tpot_s=0.02, step_fit=FIT)
    calm = decode("calm", 200, num_running=2, running_context_tokens=200, running_tpot_s=0.05, step_fit=FIT)
    choice = PathChoice(PARAMS, "prefill", "decode", metrics, board)
    cases = [
        ([busy], [prefill("p", 0)], 30, CHAT),  # its streams leave no headroom
        ([busy, calm], [prefill("p", 0)], 30, CHAT),  # the calm replica takes it
        ([calm], [prefill("p", 4000)], 900, SLOClass("long", ttft_s=4.0, tpot_s=0.05)),  # pool behind
        ([calm], [prefill("p", 0)], 900, SLOClass("long", ttft_s=4.0, tpot_s=0.05)),  # pool meets it
        ([calm], [prefill("p", 0)], 6000, CHAT),  # too slow locally
    ]
    reasons = []
    for decodes, prefills, n, cls in cases:
        board.set("decode", *decodes)
        board.set("prefill", *prefills)
        got = choice.choose(n, cls)
        d = pick_decode(decodes)
        assert d is not None
        want = decide(path_inputs(n, cls, d, prefills, PRIOR_PREFILL_RATE_TPS),
                      dataclasses.replace(PARAMS, step=StepTimeModel(*FIT)))
        assert got == want
        reasons.append(got.reason)
    assert reasons == [Reason.NO_HEADROOM, Reason.SHORT, Reason.POOL_BEHIND, Reason.REMOTE_MEETS,
                       Reason.LOCAL_TOO_SLOW]
    assert sum(decisions(metrics, p, r) for p in Path for r in Reason) == len(cases)


def test_the_prefill_rate_is_measured_between_snapshots_and_kept() -> None:
    board, metrics = Board(), RouterMetrics()
    choice = PathChoice(PARAMS, "prefill", "decode", metrics, board)
    board.set("prefill", prefill("p", tokens=1000, seconds=1.0), prefill("q", tokens=0, seconds=0.0))
    choice.choose(10, None)
    assert choice.rate_tps == PRIOR_PREFILL_RATE_TPS  # one snapshot measures nothing
    board.set("prefill", prefill("p", tokens=3000, seconds=2.0), prefill("q", tokens=600, seconds=1.0))
    choice.choose(10, None)
    assert choice.rate_tps == pytest.approx((2000 + 600) / (1.0 + 1.0))
    choice.choose(10, None)  # the same snapshot again: no window, the rate kept
    assert choice.rate_tps == pytest.approx(1300.0)


def test_no_objective_is_never_missed() -> None:
    assert math.isinf(NO_OBJECTIVE.ttft_s) and math.isinf(NO_OBJECTIVE.tpot_s)


# -- Generation on the path chosen ------------------------------------------------------------------

def setup(dec: FailingDecode, auto: bool = True) -> tuple[Generation, FakeHandle, FakeHandle, RouterMetrics]:
    ph, dh, metrics = FakeHandle(FakePrefill(None)), FakeHandle(dec), RouterMetrics()
    board = Board()
    choice = PathChoice(PARAMS, "prefill", "decode", metrics, board) if auto else None
    return Generation(Backends(ph, dh, 5.0, 5.0, 1.0), FakeCodec(), metrics, path_choice=choice), ph, dh, metrics


def inp(prompt: str, max_tokens: int, objectives: Objectives | None = None) -> GenerationInput:
    ids = tuple(ord(c) for c in prompt)
    goal = objective_for(objectives, len(ids), None, 100.0) if objectives is not None else None
    return GenerationInput(request_id="r1", prompt_token_ids=ids, n=1, objective=goal,
                           sampling=SamplingParams(max_tokens=max_tokens, stop_token_ids=(0,)))


async def text(gen: Generation, i: GenerationInput) -> str:
    return "".join([d.text async for d in gen.stream(i)])


async def test_a_short_prompt_goes_to_the_decode_pool_alone_and_a_long_one_through_the_prefill() -> None:
    dec = FailingDecode(failures=0)
    gen, ph, _, metrics = setup(dec)
    objectives = Objectives((SLOClass("all", ttft_s=10.0, tpot_s=1.0),))
    short, long = "abc", "x" * 200
    assert await text(gen, inp(short, 8, objectives)) == expected_text(short, 8)
    assert ph.calls == []  # LOCAL: no prefill call; the decode replica sends token 0
    local = dec.requests[-1]
    assert local.handle is None and local.choices[0].first_token_id is None
    assert local.tpot_s == 1.0 and local.ttft_deadline == 110.0
    assert await text(gen, inp(long, 8, objectives)) == expected_text(long, 8)
    assert ph.calls == ["prefill"] and dec.requests[-1].handle is not None
    assert decisions(metrics, Path.LOCAL, Reason.SHORT) == 1
    assert decisions(metrics, Path.REMOTE, Reason.REMOTE_MEETS) == 1
    for path in Path:  # attainment counted under the path each request took
        assert metrics.registry.get_sample_value("pdserve:slo_requests_total",
                                                 {"slo_class": "all", "path": path.value, "attained": "true"}) == 1


async def test_without_a_path_choice_every_request_is_remote() -> None:
    dec = FailingDecode(failures=0)
    gen, ph, _, _ = setup(dec, auto=False)
    assert await text(gen, inp("abc", 8)) == expected_text("abc", 8)
    assert ph.calls == ["prefill"] and dec.requests[0].handle is not None


async def test_a_local_requests_continuation_is_local() -> None:
    """Its decode replica dies mid-stream: the continuation goes to the decode pool without a handle
    (prefilled where it lands), and the prefill pool is never called."""
    dec = FailingDecode(failures=1, after=4)
    gen, ph, _, _ = setup(dec)
    assert await text(gen, inp("abc", 12)) == expected_text("abc", 12)
    first, cont = dec.requests
    assert first.handle is None and cont.handle is None and ph.calls == []
    assert cont.request_id == "r1:m1.0" and cont.choices[0].generated == tuple(ord(c) for c in expected_text("abc", 4))


def test_a_decode_report_crosses_the_controller_as_json_and_back() -> None:
    """What the decision reads survives routing stats' plain-value form (a tuple comes back a list)."""
    import json

    from router.loadboard import REPORTED_AT, report_to_stats, stats_to_report

    rep = decode("d1", 40, num_running=2, running_context_tokens=300, running_tpot_s=0.05, local_queue_tokens=12,
                 step_fit=FIT)
    stats = json.loads(json.dumps(report_to_stats(rep)))
    assert REPORTED_AT in stats and stats_to_report("d1", stats, "decode") == rep
    bare = json.loads(json.dumps(report_to_stats(decode("d2"))))
    assert stats_to_report("d2", bare, "decode").step_fit is None


def test_the_router_config_refuses_an_unknown_or_useless_prefill_path() -> None:
    from router.config import RouterConfig

    with pytest.raises(ValueError, match="prefill_path must be one of"):
        RouterConfig(prefill_path="local")
    with pytest.raises(ValueError, match="prefill_path='remote' needs mode 'disaggregated'"):
        RouterConfig(mode="colocated", prefill_path="remote")
    assert RouterConfig().prefill_path == "auto"
