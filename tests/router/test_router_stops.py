"""Stop-string matching with hold-back (no Ray)."""

from __future__ import annotations

import pytest

from router.stops import StopMatcher

pytestmark = pytest.mark.timeout(30)


def run(stops: list[str], pieces: list[str]) -> tuple[str, str | None]:
    m = StopMatcher(stops)
    out = []
    for p in pieces:
        out.append(m.feed(p))
        if m.finished:
            break
    out.append(m.flush())
    return "".join(out), m.matched


def test_no_stops_passes_everything_through() -> None:
    assert run([], ["ab", "c"]) == ("abc", None)


def test_stop_inside_one_piece() -> None:
    assert run(["STOP"], ["helloSTOPworld"]) == ("hello", "STOP")


def test_stop_across_pieces_is_never_emitted() -> None:
    m = StopMatcher(["</end>"])
    assert m.feed("abc</") == "abc"
    assert m.feed("en") == ""
    assert m.feed("d>tail") == ""
    assert m.finished and m.matched == "</end>"
    assert m.flush() == ""


def test_false_start_is_released() -> None:
    m = StopMatcher(["xyz"])
    assert m.feed("axy") == "a"
    assert m.feed("q") == "xyq"
    assert m.flush() == ""


def test_earliest_of_several_stops_wins() -> None:
    assert run(["cd", "b"], ["abcd"]) == ("a", "b")


def test_flush_returns_held_text_at_end_of_stream() -> None:
    assert run(["hello"], ["say hel"]) == ("say hel", None)


def test_every_split_of_the_text_gives_the_same_answer() -> None:
    text = "one two<stop>three"
    for i in range(len(text) + 1):
        assert run(["<stop>", "zzz"], [text[:i], text[i:]]) == ("one two", "<stop>")
    assert run(["<stop>"], list(text)) == ("one two", "<stop>")


def test_include_stop_returns_the_stop_string_and_nothing_after() -> None:
    m = StopMatcher(["STOP", "TO"], include_stop=True)
    assert m.feed("heS") + m.feed("TOP tail") + m.flush() == "heSTOP" and m.matched == "STOP"


def test_unarmed_feed_lets_a_stop_pass_and_holds_a_possible_start() -> None:
    m = StopMatcher(["xy"])
    assert m.feed("axyx", armed=False) == "axy" and not m.finished  # "x" may start a stop: held
    assert m.feed("yz") == "" and m.matched == "xy"
