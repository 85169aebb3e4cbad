"""`router.objectives` and the YAML's ``objectives:`` section: classes, classification, attainment."""

from __future__ import annotations

import pytest

from cluster.config import ClusterConfig, ConfigError
from router.objectives import Objectives, SLOClass, attained, tpot

pytestmark = pytest.mark.timeout(30)

CHAT = SLOClass("chat", ttft_s=0.5, tpot_s=0.1, max_prompt_tokens=256)
MID = SLOClass("mid", ttft_s=2.0, tpot_s=0.1, max_prompt_tokens=1024)
LONG = SLOClass("long", ttft_s=6.0, tpot_s=0.15)
BATCH = SLOClass("batch", ttft_s=60.0, tpot_s=1.0, named_only=True)
OBJ = Objectives((LONG, CHAT, BATCH, MID))  # configured order need not be sorted


@pytest.mark.parametrize(("tokens", "expected"), [(1, "chat"), (256, "chat"), (257, "mid"), (1024, "mid"),
                                                  (1025, "long"), (100_000, "long")])
def test_length_classes_by_the_smallest_bound_that_holds_the_prompt(tokens: int, expected: str) -> None:
    got = OBJ.classify(tokens)
    assert got is not None and got.name == expected


def test_a_named_class_wins_over_length_and_named_only_is_never_chosen_by_length() -> None:
    assert OBJ.classify(10, "long") == LONG
    assert OBJ.classify(10, "batch") == BATCH
    assert all(OBJ.classify(n) != BATCH for n in (1, 500, 5000))
    with pytest.raises(ValueError, match=r"'gold'.*expected one of"):
        OBJ.classify(10, "gold")


def test_no_objectives_classify_nothing_and_refuse_a_named_class() -> None:
    assert not Objectives().enabled and Objectives().classify(10) is None
    with pytest.raises(ValueError, match=r"'chat'.*no objectives"):
        Objectives().classify(10, "chat")


@pytest.mark.parametrize(("classes", "needle"), [
    ((CHAT, CHAT, LONG), "named more than once"),
    ((CHAT,), "exactly one length class without max_prompt_tokens"),
    ((CHAT, LONG, SLOClass("x", 1, 1)), "exactly one length class"),
    ((CHAT, SLOClass("c2", 1, 1, max_prompt_tokens=256), LONG), "share a max_prompt_tokens"),
])
def test_inconsistent_classes_are_refused(classes: tuple[SLOClass, ...], needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        Objectives(classes)


def test_bad_class_values_are_refused_naming_the_class() -> None:
    with pytest.raises(ValueError, match=r"'a'.*positive"):
        SLOClass("a", ttft_s=0, tpot_s=1)
    with pytest.raises(ValueError, match=r"'b'.*named_only"):
        SLOClass("b", ttft_s=1, tpot_s=1, max_prompt_tokens=10, named_only=True)


def test_attainment_needs_both_objectives() -> None:
    assert attained(0.5, 0.1, CHAT)  # on the objective counts as met
    assert not attained(0.51, 0.05, CHAT)
    assert not attained(0.1, 0.11, CHAT)
    assert attained(0.4, None, CHAT)  # one output token: TTFT alone
    assert tpot(1.0, 2.0, 11) == pytest.approx(0.1) and tpot(1.0, 1.0, 1) is None
    assert CHAT.ttft_deadline(10.0) == 10.5


OBJ_ARGS = {"classes": [{"name": "chat", "ttft_s": 0.5, "tpot_s": 0.1, "max_prompt_tokens": 256},
                        {"name": "long", "ttft_s": 6, "tpot_s": 0.15}]}


def test_the_yaml_section_reaches_the_router_config() -> None:
    cfg = ClusterConfig.from_args({"objectives": OBJ_ARGS})
    obj = cfg.router_config().objectives
    assert obj.classify(100) == SLOClass("chat", 0.5, 0.1, 256)
    assert obj.classify(300) == SLOClass("long", 6.0, 0.15)
    assert not ClusterConfig.from_args({}).router_config().objectives.enabled


@pytest.mark.parametrize(("args", "needle"), [
    ({"classes": [{**OBJ_ARGS["classes"][0], "ttft": 1}]}, "objectives.classes.0.ttft: unknown key"),
    ({"clases": []}, "objectives.clases: unknown key (allowed: classes)"),
    ({"classes": [OBJ_ARGS["classes"][0]]}, "exactly one length class without max_prompt_tokens"),
    ({"classes": [{**OBJ_ARGS["classes"][1], "tpot_s": 0}]}, "objectives.classes.0.tpot_s"),
])
def test_bad_objectives_say_what_and_where(args: dict[str, object], needle: str) -> None:
    with pytest.raises(ConfigError) as e:
        ClusterConfig.from_args({"objectives": args})
    assert needle in str(e.value)
