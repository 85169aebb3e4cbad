"""What the capacity planner serves: a workload spec (a request mix, or a trace), its objectives, and the
seeded arrivals drawn from it at a given rate.

Owns: `LengthDist` (fixed, uniform or lognormal token counts), `MixPart` (a share of the requests with
its prompt and output lengths), `WorkloadSpec` (the mix or a trace, and the objectives, read from a
YAML or JSON file), `Arrival` and `arrivals` (Poisson arrivals at a rate, or the trace's times scaled
to that rate).

The spec file::

    objectives:                    # the same section as a cluster YAML's (cluster.sections)
      classes: [{name: chat, ttft_s: 0.5, tpot_s: 0.1, max_prompt_tokens: 256}, {name: long, ...}]
    duration_s: 30                 # the arrival window simulated at each rate (long beside a request's life)
    min_requests: 200              # at low rates the window grows to hold this many
    max_requests: 20000            # past this a rate is refused: simulate a slice (pdserve plan --slice)
    seed: 0
    mix:                           # or trace: path/to/trace.jsonl ({"t", "prompt_tokens", "output_tokens"} a line)
      - {share: 0.85, prompt: {fixed: 30}, output: {fixed: 48}}
      - {share: 0.15, prompt: {lognormal: {median: 1400, sigma: 0.3}}, output: {uniform: [32, 64]}}

Invariants: unknown keys are refused, named (pydantic, ``extra="forbid"``); a spec has a mix or a trace,
not both; the same spec, rate and seed give the same arrivals everywhere. Token counts are >= 1.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from cluster.sections import ObjectivesSection
from router.objectives import Objectives


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Lognormal(_Spec):
    median: float = Field(gt=0)
    sigma: float = Field(ge=0)


class LengthDist(_Spec):
    """Exactly one of: ``fixed: n``, ``uniform: [lo, hi]`` (inclusive), ``lognormal: {median, sigma}``."""

    fixed: int | None = Field(default=None, ge=1)
    uniform: tuple[int, int] | None = None
    lognormal: Lognormal | None = None

    @model_validator(mode="after")
    def _one(self) -> LengthDist:
        given = [k for k in ("fixed", "uniform", "lognormal") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"a length needs exactly one of fixed, uniform, lognormal; got {given or 'none'}")
        if self.uniform is not None and not 1 <= self.uniform[0] <= self.uniform[1]:
            raise ValueError(f"uniform needs 1 <= lo <= hi, got {list(self.uniform)}")
        return self

    def draw(self, rng: random.Random) -> int:
        if self.fixed is not None:
            return self.fixed
        if self.uniform is not None:
            return rng.randint(*self.uniform)
        assert self.lognormal is not None
        return max(1, round(self.lognormal.median * math.exp(rng.gauss(0.0, self.lognormal.sigma))))


class MixPart(_Spec):
    share: float = Field(gt=0)
    prompt: LengthDist
    output: LengthDist


class WorkloadSpec(_Spec):
    objectives: ObjectivesSection
    duration_s: float = Field(default=30.0, gt=0)
    min_requests: int = Field(default=200, ge=2)
    max_requests: int = Field(default=20000, ge=2)
    seed: int = 0
    mix: list[MixPart] | None = Field(default=None, min_length=1)
    trace: str | None = None

    @model_validator(mode="after")
    def _mix_or_trace(self) -> WorkloadSpec:
        if (self.mix is None) == (self.trace is None):
            raise ValueError("a workload needs exactly one of mix, trace")
        if self.min_requests > self.max_requests:
            raise ValueError(f"min_requests {self.min_requests} exceeds max_requests {self.max_requests}")
        if not self.objectives.classes:
            raise ValueError("objectives.classes: the planner needs objectives to judge attainment")
        return self

    @classmethod
    def load(cls, path: str | Path) -> WorkloadSpec:
        text = Path(path).read_text()
        data = json.loads(text) if str(path).endswith(".json") else yaml.safe_load(text)
        try:
            spec = cls.model_validate(data or {})
        except ValidationError as e:
            raise ValueError(_format(e, str(path))) from None
        if spec.trace is not None and not Path(spec.trace).is_absolute():
            spec = spec.model_copy(update={"trace": str(Path(path).parent / spec.trace)})
        return spec

    def built_objectives(self) -> Objectives:
        return self.objectives.build()


def _format(e: ValidationError, source: str) -> str:
    lines = [f"{source}: invalid workload ({e.error_count()} problem{'s' * (e.error_count() > 1)}):"]
    for err in e.errors():
        loc = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            allowed = f" (allowed: {', '.join(WorkloadSpec.model_fields)})" if len(err["loc"]) == 1 else ""
            lines.append(f"  - {loc}: unknown key{allowed}")
        else:
            lines.append(f"  - {loc}: {str(err['msg']).removeprefix('Value error, ')}")
    return "\n".join(lines)


@dataclass(frozen=True)
class Arrival:
    t: float  # seconds from the start
    prompt_tokens: int
    output_tokens: int


def _trace(path: str) -> list[Arrival]:
    out = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if line.strip():
            d = json.loads(line)
            if set(d) != {"t", "prompt_tokens", "output_tokens"}:
                raise ValueError(f"{path}:{n}: a trace line has exactly t, prompt_tokens, output_tokens; "
                                 f"got {sorted(d)}")
            out.append(Arrival(float(d["t"]), max(1, int(d["prompt_tokens"])), max(1, int(d["output_tokens"]))))
    if len(out) < 2:
        raise ValueError(f"{path}: a trace needs at least two requests")
    return sorted(out, key=lambda a: a.t)


def arrivals(spec: WorkloadSpec, rate: float) -> list[Arrival]:
    """Poisson arrivals at ``rate`` requests/s over ``spec.duration_s`` (at least ``min_requests``), or the
    trace rescaled to that mean rate; more than ``max_requests`` is refused, naming it."""
    if not rate > 0:
        raise ValueError(f"rate must be positive, got {rate}")
    if spec.trace is not None:
        trace = _trace(spec.trace)
        t0, span = trace[0].t, trace[-1].t - trace[0].t
        scale = (len(trace) - 1) / rate / span if span > 0 else 0.0
        return [Arrival((a.t - t0) * scale, a.prompt_tokens, a.output_tokens) for a in trace]
    assert spec.mix is not None
    rng = random.Random(spec.seed)
    shares = [p.share for p in spec.mix]
    t, out = rng.expovariate(rate), list[Arrival]()
    while t < spec.duration_s or len(out) < spec.min_requests:
        if len(out) == spec.max_requests:
            raise ValueError(f"rate {rate:g}/s over duration_s {spec.duration_s:g} is past max_requests "
                             f"{spec.max_requests}: simulate a slice (--slice) or shorten duration_s")
        part = rng.choices(spec.mix, weights=shares)[0]
        out.append(Arrival(t, part.prompt.draw(rng), part.output.draw(rng)))
        t += rng.expovariate(rate)
    return out
