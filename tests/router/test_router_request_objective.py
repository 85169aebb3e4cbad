"""`router.request_objective`: a request's class and TTFT deadline from its prompt, its ``slo_class``
field and its arrival; its attainment judged and counted at the end (read back from the registry)."""

from __future__ import annotations

import logging

import pytest

from router.errors import APIError
from router.fields import account
from router.metrics import RouterMetrics
from router.objectives import Objectives, SLOClass
from router.path_policy import Path
from router.protocol import ChatCompletionRequest, CompletionRequest
from router.request_objective import RequestObjective, objective_for, record_attainment

pytestmark = pytest.mark.timeout(30)

CHAT = SLOClass("chat", ttft_s=0.5, tpot_s=0.1, max_prompt_tokens=256)
LONG = SLOClass("long", ttft_s=6.0, tpot_s=0.15)
BATCH = SLOClass("batch", ttft_s=60.0, tpot_s=1.0, named_only=True)
OBJ = Objectives((CHAT, LONG, BATCH))
SLO = "pdserve:slo_requests_total"


@pytest.mark.parametrize(("tokens", "name", "cls"), [(30, None, CHAT), (256, None, CHAT), (257, None, LONG),
                                                     (30, "long", LONG), (5000, "batch", BATCH)])
def test_the_class_by_length_or_by_name_and_its_deadline(tokens: int, name: str | None, cls: SLOClass) -> None:
    assert objective_for(OBJ, tokens, name, 1000.0) == RequestObjective(cls, 1000.0 + cls.ttft_s)


def test_without_objectives_nothing_travels() -> None:
    assert objective_for(Objectives(), 30, None, 1000.0) is None


@pytest.mark.parametrize(("objectives", "name", "needle"), [(OBJ, "gold", "expected one of"),
                                                            (Objectives(), "chat", "no objectives")])
def test_a_class_not_configured_is_a_400_naming_the_field(objectives: Objectives, name: str, needle: str) -> None:
    with pytest.raises(APIError) as e:
        objective_for(objectives, 30, name, 1000.0)
    assert e.value.status == 400 and e.value.param == "slo_class"
    assert e.value.message.startswith("slo_class:") and name in e.value.message and needle in e.value.message


@pytest.mark.parametrize("model", [ChatCompletionRequest, CompletionRequest])
def test_both_endpoints_serve_the_field(model: type[ChatCompletionRequest] | type[CompletionRequest],
                                        caplog: pytest.LogCaptureFixture) -> None:
    body = {"model": "m", "slo_class": "batch", "messages": [{"role": "user", "content": "hi"}], "prompt": "hi"}
    with caplog.at_level(logging.WARNING, logger="pdserve.router"):
        account({"model": "m", "slo_class": "batch"}, frozenset(model.model_fields))  # neither refused
    assert "slo_class" not in caplog.text  # nor dropped as unknown
    assert model.model_validate(body).slo_class == "batch"
    assert model.model_validate({k: v for k, v in body.items() if k != "slo_class"}).slo_class is None


@pytest.mark.parametrize(("first", "last", "tokens", "met"), [
    (10.5, 10.5 + 0.1 * 47, 48, True),  # on both objectives counts as met
    (10.6, 10.6 + 0.1 * 47, 48, False),  # the first token late
    (10.2, 10.2 + 0.11 * 47, 48, False),  # the tokens after it too slow
    (10.2, 10.2, 1, True),  # one token: no TPOT, judged on the first alone
    (10.7, 10.7, 1, False),
])
def test_attainment_is_judged_and_counted_by_class_and_path(first: float, last: float, tokens: int,
                                                            met: bool) -> None:
    m = RouterMetrics()
    obj = objective_for(OBJ, 30, None, 1000.0)
    assert record_attainment(m, obj, Path.REMOTE, 10.0, first, last, tokens) is met
    labels = {"slo_class": "chat", "path": "remote"}
    assert m.registry.get_sample_value(SLO, labels | {"attained": str(met).lower()}) == 1.0
    assert m.registry.get_sample_value(SLO, labels | {"attained": str(not met).lower()}) is None


def test_each_request_counted_once_under_its_own_class_and_path() -> None:
    m = RouterMetrics()
    chat, long = objective_for(OBJ, 30, None, 0.0), objective_for(OBJ, 2000, None, 0.0)
    record_attainment(m, chat, Path.LOCAL, 0.0, 0.2, 1.0, 10)
    record_attainment(m, chat, Path.LOCAL, 0.0, 0.3, 1.0, 10)
    record_attainment(m, long, Path.REMOTE, 0.0, 7.0, 9.0, 10)  # 7 s > 6 s: missed
    get = m.registry.get_sample_value
    assert get(SLO, {"slo_class": "chat", "path": "local", "attained": "true"}) == 2.0
    assert get(SLO, {"slo_class": "long", "path": "remote", "attained": "false"}) == 1.0
    assert get(SLO, {"slo_class": "chat", "path": "remote", "attained": "true"}) is None


def test_without_objectives_nothing_is_counted_and_times_out_of_order_are_refused() -> None:
    m = RouterMetrics()
    assert record_attainment(m, None, Path.REMOTE, 0.0, 0.2, 1.0, 10) is None
    assert not [s for f in m.registry.collect() if f.name == SLO[:-len("_total")] for s in f.samples]
    with pytest.raises(ValueError, match="arrival <= first token <= last token"):
        record_attainment(m, objective_for(OBJ, 30, None, 0.0), Path.REMOTE, 1.0, 0.5, 2.0, 10)
