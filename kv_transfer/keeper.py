"""`SourceKeeper`: keeps a decode replica paired with every KV source of the prefill pool, ahead of requests.

Owns the decode side's view of which prefill sources exist: it is told the current set (`update`,
or a `run` loop polling a callable; the decode deployment polls the prefill replicas' load reports),
meets each new source in the background, retries a failed meeting with exponential backoff, re-meets
a source whose pair was lost (a restarted replica on the same address), and forgets a source that
left the set (`Peers.forget`: its pair is closed after any transfer on it). The decision is a pure
function, `plan`, over the wanted set and the keeper's books; this class only carries it out.

Life cycle of a source, as the keeper sees it:

    listed ─▶ meeting (a task of `Peers`, bounded by ``pair_timeout_s``) ─▶ paired
                  └─ failed ─▶ wait ``backoff.delay(failures)`` ─▶ meeting again
    paired, pair lost ─▶ meeting again (no wait: the first failure waits)
    no longer listed ─▶ forgotten (meeting cancelled, pair closed)

Invariants: `update` never blocks and never raises for one source's failure (each meeting is its own
task; a refusing or vanished source only delays itself); at most one meeting per source at a time
(`Peers.meeting`); a source is forgotten only once it leaves the set; a pull for a source not yet
paired still works (it waits for the meeting within its own deadline; `KVPuller` counts it).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Coroutine, Iterable, Mapping, Set
from dataclasses import dataclass

from kv_transfer.peers import Peers, Source

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Backoff:
    """The wait before meeting a source again after ``failures`` failed meetings in a row."""

    first_s: float = 1.0
    max_s: float = 30.0

    def delay(self, failures: int) -> float:
        return 0.0 if failures <= 0 else min(self.max_s, self.first_s * 2.0 ** (failures - 1))


@dataclass(frozen=True)
class SourceBook:
    """What the keeper remembers of one listed source: failed meetings in a row, and when to try again."""

    failures: int = 0
    retry_at: float = 0.0


@dataclass(frozen=True)
class Plan:
    meet: tuple[Source, ...]  # listed, not paired, no meeting under way, not waiting out a backoff
    forget: tuple[Source, ...]  # known but no longer listed


def plan(wanted: Set[Source], books: Mapping[Source, SourceBook], paired: Set[Source],
         meeting: Set[Source], now: float) -> Plan:
    """What to do now (pure): meet and forget, each in a stable (sorted) order."""
    meet = [s for s in wanted if s not in paired and s not in meeting
            and books.get(s, SourceBook()).retry_at <= now]
    forget = [s for s in books if s not in wanted]
    return Plan(meet=tuple(sorted(meet)), forget=tuple(sorted(forget)))


@dataclass(frozen=True)
class KeeperStats:
    listed: int  # sources in the latest set
    paired: int  # of those, with a pair up
    meeting: int  # of those, with a meeting under way
    failing: int  # of those, whose last meeting failed (waiting out a backoff or retrying)


class SourceKeeper:
    """Carries out `plan` on a `Peers`; see the module docstring."""

    def __init__(self, peers: Peers, backoff: Backoff | None = None) -> None:
        self.peers = peers
        self.backoff = backoff or Backoff()
        self._books: dict[Source, SourceBook] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def update(self, sources: Iterable[Source]) -> Plan:
        """Take ``sources`` as the whole current set: meet the new (or lost), forget the gone."""
        wanted = set(sources)
        now = asyncio.get_running_loop().time()
        paired = {s for s in wanted if self.peers.paired(s) is not None}
        meeting = {s for s in wanted if self.peers.is_meeting(s)}
        todo = plan(wanted, self._books, paired, meeting, now)
        for source in todo.forget:
            del self._books[source]
            self._spawn(self.peers.forget(source), f"kv-forget-{source[0]}:{source[1]}")
        for source in wanted:
            self._books.setdefault(source, SourceBook())
        for source in todo.meet:
            self.peers.meeting(source).add_done_callback(functools.partial(self._settled, source))
        return todo

    async def run(self, listed: Callable[[], Iterable[Source]], interval_s: float) -> None:
        """Poll ``listed`` every ``interval_s`` and `update` from it, until cancelled."""
        while True:
            try:
                self.update(listed())
            except Exception:  # a failing poll must not end the keeping
                log.exception("KV source keeper: polling the prefill pool failed")
            await asyncio.sleep(interval_s)

    def stats(self) -> KeeperStats:
        listed = list(self._books)
        return KeeperStats(listed=len(listed),
                           paired=sum(self.peers.paired(s) is not None for s in listed),
                           meeting=sum(self.peers.is_meeting(s) for s in listed),
                           failing=sum(b.failures > 0 for b in self._books.values()))

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _settled(self, source: Source, task: asyncio.Task[None]) -> None:
        if source not in self._books:
            return  # forgotten meanwhile
        if task.cancelled() or task.exception() is not None:
            failures = self._books[source].failures + 1
            delay = self.backoff.delay(failures)
            self._books[source] = SourceBook(failures, asyncio.get_running_loop().time() + delay)
            log.info("KV source keeper: meeting %s failed (%d in a row); next try in %.1f s",
                     source, failures, delay)
        else:
            self._books[source] = SourceBook()

    def _spawn(self, work: Coroutine[object, object, None], name: str) -> None:
        task = asyncio.create_task(work, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
