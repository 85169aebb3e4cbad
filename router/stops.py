"""Stop strings over a stream of decoded text: emit what is safe, hold back what might be a stop.

Owns: `StopMatcher`, a small pure state machine fed with text pieces as tokens are detokenized.

Invariants: nothing after a stop string is ever returned, nor the stop string itself unless the
matcher was built with ``include_stop`` (vLLM's ``include_stop_str_in_output``); text is held back
only while the end of what was seen could still be the start of a stop string (so at most
``max(len(stop)) - 1`` characters wait); once a stop matched, the matcher is finished and returns
nothing more; `flush` hands back whatever is held when the stream ends without a match.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    """Finds the earliest occurrence of any stop string in the text fed so far."""

    def __init__(self, stops: Sequence[str], include_stop: bool = False) -> None:
        self._stops = tuple(s for s in stops if s)
        self._include = include_stop
        self._longest = max((len(s) for s in self._stops), default=0)
        self._held = ""
        self.matched: str | None = None

    @property
    def finished(self) -> bool:
        return self.matched is not None

    def feed(self, text: str, armed: bool = True) -> str:
        """Add ``text``; return the part that can be emitted now (check `finished` after).

        ``armed=False`` (before vLLM's ``min_tokens``): no stop can match yet, so a whole stop
        string passes; the tail that may start one is still held back, to be matched once armed.
        """
        if self.finished:
            return ""
        if not self._stops:
            return text
        buf = self._held + text
        hit = -1
        for stop in self._stops if armed else ():
            i = buf.find(stop)
            if i >= 0 and (hit < 0 or i < hit):
                hit, self.matched = i, stop
        if hit >= 0:
            self._held = ""
            assert self.matched is not None
            return buf[: hit + len(self.matched)] if self._include else buf[:hit]
        keep = self._partial_suffix(buf)
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[: len(buf) - keep]

    def _partial_suffix(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of some stop string."""
        for k in range(min(len(buf), self._longest - 1), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self._stops):
                return k
        return 0

    def flush(self) -> str:
        """End of stream without a match: everything held back is plain text after all."""
        out, self._held = ("" if self.finished else self._held), ""
        return out
