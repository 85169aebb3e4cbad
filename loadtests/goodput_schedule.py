"""The goodput benchmark's load: one seeded open-loop schedule per offered rate, the same for every server.

Owns `Sweep` (the offered rates, how long each is offered, the fewest requests a rate may hold, the
workload profile, the seed), `Arrival` (one request: when it is sent, its kind, its body) and
`schedule` (Poisson arrival times at a rate over its window, kinds in the profile's proportions).

Invariants: the same sweep, rate and seed give byte-identical arrivals in every process, so each
server under test gets the same requests at the same offsets. A rate's window is long enough to
hold ``min_requests`` arrivals on average (``window_s``): at low rates a fixed duration would hold
too few requests for its attainment to mean anything. Kinds are stratified, not drawn one by one:
independent 15% draws over a few dozen requests would give rates with half or twice the documents
the profile says, and the sweep would measure the draw, not the server. Pure: no clock, no I/O.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from loadtests.bench_common import MODEL
from loadtests.profiles import Profile, Workload, chat_body, get_profile

#: Offered rates (requests/s): steps of about 1.4×, finer than the 1.5× and 2× the issue's targets compare.
DEFAULT_RATES: tuple[float, ...] = (0.15, 0.25, 0.35, 0.5, 0.7, 1.0)


@dataclass(frozen=True)
class Sweep:
    rates: tuple[float, ...] = DEFAULT_RATES
    duration_s: float = 60.0  # the shortest window a rate is offered for
    min_requests: int = 40  # a rate's window grows until it holds this many requests on average
    drain_s: float = 60.0  # after the window: how long requests in flight may still finish
    profile: str = "goodput"
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.rates or any(r <= 0 for r in self.rates):
            raise ValueError(f"rates must be positive, got {list(self.rates)}")
        if self.duration_s <= 0 or self.drain_s < 0 or self.min_requests < 1:
            raise ValueError(f"need duration_s > 0, drain_s >= 0, min_requests >= 1: {self}")
        get_profile(self.profile)  # an unknown profile is refused here, naming the known ones

    def window_s(self, rate: float) -> float:
        """How long ``rate`` is offered: ``duration_s``, or longer where that holds < ``min_requests``."""
        return max(self.duration_s, self.min_requests / rate)


@dataclass(frozen=True)
class Arrival:
    at_s: float  # seconds after the rate's start
    workload: Workload
    body: dict[str, Any]


def schedule(rate: float, window_s: float, profile: str, seed: int) -> list[Arrival]:
    """Poisson arrivals at ``rate`` over ``window_s``, kinds in the profile's proportions, one seeded stream."""
    rng = random.Random(f"{seed}-{rate}")
    times: list[float] = []
    t = rng.expovariate(rate)
    while t < window_s:
        times.append(t)
        t += rng.expovariate(rate)
    kinds = stratified(get_profile(profile), len(times), rng)
    return [Arrival(at, w, chat_body(MODEL, w, rng)) for at, w in zip(times, kinds, strict=True)]


def stratified(profile: Profile, n: int, rng: random.Random) -> list[Workload]:
    """``n`` workloads in the profile's proportions (each kind at least once when n allows), shuffled."""
    weighted = sorted(profile.workloads, key=lambda x: -x[1])
    total = sum(wt for _, wt in weighted)
    counts = [max(1, round(n * wt / total)) if n >= len(weighted) else 0 for _, wt in weighted]
    counts[0] += n - sum(counts)  # the most common kind absorbs the rounding
    out = [w for (w, _), c in zip(weighted, counts, strict=True) for _ in range(c)]
    rng.shuffle(out)
    return out
