"""The goodput benchmark's arithmetic: objectives from a lone baseline, attainment per rate, knees, targets.

Owns `Baseline` (one request at a time: each class's TTFT, the chat TPOT), `SLO` (a TTFT objective per
class and one TPOT objective, with where they came from; `SLO.objectives_section` is the same objectives
as a cluster YAML's ``objectives:`` section, so the servers judge and route by what the client judges),
`RateRun` (what one server did at one offered rate), `rate_point`, `knee` and `targets` (issue #33's).

Invariants: a request attains when it finished, its TTFT is within its class's objective and its TPOT
(when it has one: a one-token output has none) within the TPOT objective; attainment is over every
request sent in the rate's window, so a request cut at the drain counts as missed, never dropped.
The knee is the highest rate up to which every rate of the sweep held the target: a single lucky point
past a failing one does not move it (`rate_point` keeps every point for reading). Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from loadtests.bench_common import RequestRecord, summarize
from loadtests.profiles import get_profile

KINDS = ("chat", "long")
TARGET = 0.9  # the attainment a rate must hold to count below the knee


@dataclass(frozen=True)
class Baseline:
    """Medians of lone requests (ms): each class's TTFT, and the chat TPOT."""

    chat_ttft_ms: float
    long_ttft_ms: float
    chat_tpot_ms: float
    server: str  # where it was measured


@dataclass(frozen=True)
class SLO:
    chat_ttft_ms: float
    long_ttft_ms: float
    tpot_ms: float
    source: str  # in words: measured where and scaled how, or given

    @classmethod
    def from_baseline(cls, b: Baseline, scale: float = 3.0) -> SLO:
        def sig2(x: float) -> float:
            return float(f"{x:.2g}")

        return cls(sig2(scale * b.chat_ttft_ms), sig2(scale * b.long_ttft_ms), sig2(scale * b.chat_tpot_ms),
                   f"{scale:g}x each class's lone TTFT and {scale:g}x the lone chat TPOT, one request at a time "
                   f"on {b.server} (rounded to 2 significant digits)")

    def ttft_ms(self, kind: str) -> float:
        if kind not in KINDS:
            raise ValueError(f"no TTFT objective for request kind {kind!r}; kinds: {list(KINDS)}")
        return self.chat_ttft_ms if kind == "chat" else self.long_ttft_ms

    def attained(self, r: RequestRecord) -> bool:
        if not r.ok or r.ttft is None or r.ttft * 1e3 > self.ttft_ms(r.kind):
            return False
        return r.tpot is None or r.tpot * 1e3 <= self.tpot_ms

    def objectives_section(self, profile: str) -> dict[str, Any]:
        """The objectives as a cluster YAML's ``objectives:``: chat by prompt length, long the catch-all."""
        chat = next(w for w, _ in get_profile(profile).workloads if w.name == "chat")
        tpot_s = self.tpot_ms / 1e3
        return {"classes": [
            {"name": "chat", "ttft_s": self.chat_ttft_ms / 1e3, "tpot_s": tpot_s,
             "max_prompt_tokens": chat.prompt_tokens + 8},  # room for the tokenizer's rounding
            {"name": "long", "ttft_s": self.long_ttft_ms / 1e3, "tpot_s": tpot_s}]}

    def as_json(self) -> dict[str, Any]:
        return {"ttft_ms": {"chat": self.chat_ttft_ms, "long": self.long_ttft_ms}, "tpot_ms": self.tpot_ms,
                "reason": self.source}


@dataclass
class RateRun:
    """One server at one offered rate: every request sent in the window, and the server's counters."""

    rate: float
    window_s: float
    t0: float = 0.0
    records: list[RequestRecord] = field(default_factory=list)
    path_decisions: dict[str, float] | None = None  # "path/reason" → decisions in this rate (pdserve only)
    server_slo: dict[str, float] | None = None  # "class/path/attained" → requests the router judged


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1e3, 2)


def _latency(records: Sequence[RequestRecord]) -> dict[str, Any]:
    return {"ttft_ms": summarize([x * 1e3 for r in records if (x := r.ttft) is not None]),
            "tpot_ms": summarize([x * 1e3 for r in records if (x := r.tpot) is not None]),
            "itl_ms": summarize([g * 1e3 for r in records for _, g in r.itls()])}


def rate_point(run: RateRun, slo: SLO) -> dict[str, Any]:
    n = len(run.records)
    ok = [slo.attained(r) for r in run.records]
    classes = {}
    for kind in KINDS:
        mine = [r for r, a in zip(run.records, ok, strict=True) if r.kind == kind]
        hit = sum(a for r, a in zip(run.records, ok, strict=True) if r.kind == kind)
        classes[kind] = {"sent": len(mine), "attained": hit, "attainment": round(hit / len(mine), 4) if mine else None,
                         **_latency(mine)}
    return {
        "rate_rps": run.rate, "window_s": round(run.window_s, 3), "sent": n,
        "finished": sum(r.ok for r in run.records), "attained": sum(ok),
        "attainment": round(sum(ok) / n, 4) if n else 0.0,
        "goodput_rps": round(sum(ok) / run.window_s, 4),
        **_latency(run.records),
        "classes": classes,
        "path_decisions": run.path_decisions,
        "server_slo": run.server_slo,
        "samples": [[r.kind, round(r.sent - run.t0, 3), _ms(r.ttft), _ms(r.tpot), r.ok] for r in run.records],
    }


def knee(points: Sequence[Mapping[str, Any]], target: float = TARGET) -> float | None:
    """The highest rate up to which every point held ``target`` attainment (None: not even the lowest)."""
    held = None
    for p in sorted(points, key=lambda p: p["rate_rps"]):
        if p["attainment"] < target:
            break
        held = p["rate_rps"]
    return held


def _row(name: str, description: str, value: float | None, threshold: float, met: bool | None) -> dict[str, Any]:
    return {"name": name, "description": description, "value": value, "threshold": threshold, "met": met}


def targets(servers: Mapping[str, Mapping[str, Any]], default: str = "default") -> list[dict[str, Any]]:
    """Issue #33's goodput targets for ``default`` against every other server that ran (met None where
    a server is missing, or a ratio's denominator never held the target: no figure to judge)."""
    out: list[dict[str, Any]] = []
    mine = servers.get(default)
    if mine is None:
        return out
    at = {p["rate_rps"]: p["attainment"] for p in mine["rates"]}
    for name, s in servers.items():
        if name == default:
            continue
        shared = [(at[p["rate_rps"]], p["attainment"]) for p in s["rates"] if p["rate_rps"] in at]
        gap = round(min(a - b for a, b in shared), 4) if shared else None
        out.append(_row(f"attainment_vs_{name}", f"{default} attainment − {name}'s, the least over the rates both "
                        f"ran (>= 0 at every rate)", gap, 0.0, None if gap is None else gap >= 0))
    for other, factor in (("vllm", 1.5), ("colocated-chunked", 2.0)):
        theirs = servers.get(other)
        k_mine = mine.get("knee_rps")
        k_theirs = None if theirs is None else theirs.get("knee_rps")
        ratio = round(k_mine / k_theirs, 3) if k_mine and k_theirs else None
        if theirs is None:
            met = None
        elif k_mine is None:
            met = False  # the default never held the target: no multiple of anything
        else:
            met = None if k_theirs is None else ratio is not None and ratio >= factor
        out.append(_row(f"knee_vs_{other}", f"{default}'s highest rate at >= {TARGET:.0%} attainment ÷ {other}'s "
                        f"(>= {factor:g})", ratio, factor, met))
    return out


def table(servers: Mapping[str, Mapping[str, Any]]) -> str:
    """Attainment per server and rate (chat / long in brackets), and each server's knee."""
    rates = sorted({p["rate_rps"] for s in servers.values() for p in s["rates"]})
    head = f"{'server':<18}" + "".join(f"{r:>16g}" for r in rates) + f"{'knee':>8}"
    lines = [head, "-" * len(head)]
    for name, s in servers.items():
        by = {p["rate_rps"]: p for p in s["rates"]}
        cells = []
        for r in rates:
            p = by.get(r)
            if p is None:
                cells.append(f"{'—':>16}")
                continue
            c = p["classes"]
            parts = [f"{100 * c[k]['attainment']:.0f}" if c[k]["attainment"] is not None else "—" for k in KINDS]
            cells.append(f"{100 * p['attainment']:>6.0f}% ({'/'.join(parts)})".rjust(16))
        k = s.get("knee_rps")
        lines.append(f"{name:<18}" + "".join(cells) + f"{'—' if k is None else f'{k:g}':>8}")
    lines.append("cells: attainment of both objectives, all requests (chat / long); knee: req/s")
    return "\n".join(lines)
