"""The GPU check's results: one `Check` per verdict, the JSON document and the printed table.

Owns: `Check` (a section, a name, a status, the figures behind it and the reason for a failure or a
skip), `guarded` (a section's checks, or one failure naming what it raised), `report_doc` (the
``results/gpu_check.json`` document), `GPU_CHECK_SCHEMA` (its JSON Schema), `format_table` and
`failed`.

Invariants: a check's status is ``pass``, ``fail`` or ``skip``; a skip or a failure always says why;
``passed`` in the JSON is the status as true / false / null (skipped), never a guess; figures are
plain numbers, strings, booleans or lists of them (JSON as written, no NaN). Only correctness checks
(``kind == "correctness"``) decide the exit status: timings are figures to read, not verdicts.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Literal

Status = Literal["pass", "fail", "skip"]
Figure = float | int | str | bool | list[float] | list[int] | list[str] | None


@dataclass
class Check:
    """One verdict of the GPU check."""

    section: str  # "families", "backends", "graphs", "sampler", "nccl", "timing", "budget"
    name: str  # unique within its section, e.g. "llama/fp32-greedy/torch"
    status: Status
    figures: dict[str, Figure] = field(default_factory=dict)
    reason: str = ""  # why it failed or was skipped; a note where it passed
    kind: Literal["correctness", "timing"] = "correctness"

    def __post_init__(self) -> None:
        if self.status not in ("pass", "fail", "skip"):
            raise ValueError(f"check {self.name}: unknown status {self.status!r}")
        if self.status != "pass" and not self.reason:
            raise ValueError(f"check {self.name}: a {self.status} must say why")

    @property
    def passed(self) -> bool | None:
        return None if self.status == "skip" else self.status == "pass"

    def to_json(self) -> dict[str, Any]:
        return {"section": self.section, "name": self.name, "kind": self.kind, "status": self.status,
                "passed": self.passed, "figures": {k: _clean(v) for k, v in self.figures.items()},
                "reason": self.reason}


def _clean(value: Figure) -> Figure:
    """NaN / inf are not JSON: written as null (the figure was not measurable)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, list):
        return [None if isinstance(v, float) and not math.isfinite(v) else v for v in value]  # type: ignore[return-value]
    return value


def failed(checks: Sequence[Check]) -> list[Check]:
    """The correctness checks that failed (what makes the exit status non-zero)."""
    return [c for c in checks if c.kind == "correctness" and c.status == "fail"]


def guarded(section: str, name: str, fn: Callable[[], list[Check]]) -> list[Check]:
    """``fn``'s checks, or one failed check naming the exception it raised."""
    try:
        return fn()
    except Exception as e:  # a section must report, never abort the run
        return [Check(section, name, "fail", reason=f"{type(e).__name__}: {e}"[:500])]


def report_doc(checks: Sequence[Check], machine: dict[str, Any], setup: dict[str, Any],
               wall_s: float, created: datetime | None = None, complete: bool = True) -> dict[str, Any]:
    """The ``results/gpu_check.json`` document (see `GPU_CHECK_SCHEMA`); ``complete``: False while
    sections are still to run (``passed`` then speaks only for the checks so far)."""
    counts = {s: sum(c.status == s for c in checks) for s in ("pass", "fail", "skip")}
    return {
        "benchmark": "gpu_check",
        "created": (created or datetime.now(timezone.utc)).isoformat(timespec="seconds"),
        "machine": machine,
        "setup": setup,
        "results": {"complete": complete, "passed": not failed(checks), "wall_s": round(wall_s, 1), "counts": counts,
                    "checks": [c.to_json() for c in checks]},
    }


_FIGURE = {"type": ["number", "string", "boolean", "array", "null"]}
GPU_CHECK_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "required": ["benchmark", "created", "machine", "setup", "results"],
    "properties": {
        "benchmark": {"const": "gpu_check"},
        "created": {"type": "string", "format": "date-time"},
        "machine": {"type": "object", "required": ["device", "gpu", "torch"]},
        "setup": {"type": "object", "required": ["description"]},
        "results": {
            "type": "object",
            "required": ["complete", "passed", "wall_s", "counts", "checks"],
            "properties": {
                "complete": {"type": "boolean"},
                "passed": {"type": "boolean"},
                "wall_s": {"type": "number", "minimum": 0},
                "counts": {"type": "object", "required": ["pass", "fail", "skip"]},
                "checks": {"type": "array", "items": {
                    "type": "object",
                    "required": ["section", "name", "kind", "status", "passed", "figures", "reason"],
                    "properties": {
                        "section": {"type": "string"}, "name": {"type": "string"},
                        "kind": {"enum": ["correctness", "timing"]},
                        "status": {"enum": ["pass", "fail", "skip"]},
                        "passed": {"type": ["boolean", "null"]},
                        "figures": {"type": "object", "additionalProperties": _FIGURE},
                        "reason": {"type": "string"},
                    },
                    "additionalProperties": False,
                }},
            },
        },
    },
}


def _fmt(value: Figure) -> str:
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list):
        return "[" + ", ".join(_fmt(v) for v in value[:6]) + (", …]" if len(value) > 6 else "]")
    return str(value)


def format_table(checks: Sequence[Check], max_figures: int = 4, width: int = 120) -> str:
    """One line per check: status, section/name, its first figures (or the reason), cut to ``width``."""
    lines = [f"{'status':<6}  {'check':<40}  figures / reason", "-" * width]
    for c in checks:
        shown = ", ".join(f"{k}={_fmt(v)}" for k, v in list(c.figures.items())[:max_figures])
        detail = f"{c.reason} ({shown})" if c.reason and shown else c.reason or shown
        line = f"{c.status.upper():<6}  {c.section + '/' + c.name:<40}  {detail}"
        lines.append(line if len(line) <= width else line[: width - 1] + "…")
    counts = {s: sum(c.status == s for c in checks) for s in ("pass", "fail", "skip")}
    lines.append("-" * width)
    lines.append(f"{counts['pass']} passed, {counts['fail']} failed, {counts['skip']} skipped")
    return "\n".join(lines)
