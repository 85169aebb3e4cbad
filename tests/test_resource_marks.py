"""The rule for a missing resource (tests/support/markers.py): a skip naming it and how to install it on a
developer's machine, a failure with the same words under PDSERVE_REQUIRE_RESOURCES=1 (what CI sets)."""

from __future__ import annotations

import pytest

from tests.support.markers import REQUIRE_ENV, Resource, check_resource_marks, require

ABSENT = Resource("the frobnicator", lambda: None, "apt-get install frob")
PRESENT = Resource("a shell", lambda: "/bin/sh", "it is always there")


class MarkedItem:
    """What `check_resource_marks` reads of a pytest item: its ``resource`` marks."""

    def __init__(self, *marks: pytest.MarkDecorator) -> None:
        self.marks = [m.mark for m in marks]

    def iter_markers(self, name: str) -> list[pytest.Mark]:
        return [m for m in self.marks if m.name == name]


def test_a_present_resource_gives_its_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(REQUIRE_ENV, "1")
    assert require(PRESENT) == "/bin/sh"


def test_a_missing_resource_skips_on_a_laptop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(REQUIRE_ENV, raising=False)
    with pytest.raises(pytest.skip.Exception, match=r"needs the frobnicator.*apt-get install frob"):
        require(ABSENT)


def test_a_missing_resource_fails_in_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(REQUIRE_ENV, "1")
    with pytest.raises(pytest.fail.Exception, match=r"needs the frobnicator.*apt-get install frob.*"
                                                    rf"{REQUIRE_ENV}=1"):
        require(ABSENT)


def test_marks_are_checked_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(REQUIRE_ENV, "1")
    check_resource_marks(MarkedItem(pytest.mark.resource(PRESENT), pytest.mark.slow))  # type: ignore[arg-type]
    with pytest.raises(pytest.fail.Exception, match="frobnicator"):
        check_resource_marks(MarkedItem(pytest.mark.resource(PRESENT), pytest.mark.resource(ABSENT)))  # type: ignore[arg-type]

