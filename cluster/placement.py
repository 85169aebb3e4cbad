"""Where each deployment runs and how many of it: placement, autoscaling, drain, and a capacity check.

Owns:
- the YAML sections every deployment (``router``, ``prefill``, ``decode``) has: ``placement``
  (`PlacementSection`: ``resources``, Ray custom resources per replica, e.g. ``{prefill_node: 0.01}``;
  ``label_selector``, Ray node labels, e.g. ``{pdserve.io/pool: prefill}``; ``max_replicas_per_node``),
  ``autoscaling`` (`AutoscalingSection`: Serve's min/max replicas, target ongoing requests; the pools
  add a policy of their own, `cluster.autoscaling`) and
  ``drain`` (`DrainSection`: Serve's graceful shutdown), plus the rule between replica count and
  autoscaling (`check_scaling`);
- their translation into ``Deployment.options(...)`` (`serve_options`) and ``ray_actor_options``
  (`actor_placement`), used by `cluster.app.compose_app`;
- `pack`: first-fit of every deployment's replicas (at their maximum count, `demand`) onto node
  groups (``ray start --resources/--labels``, KubeRay worker groups), reporting what does not fit and why.

Reads a deployment's section through the `Scaling` protocol, never the whole cluster config:
`cluster.config` builds on this module, not the reverse.

Invariants: a pool either has a fixed ``num_replicas`` or an ``autoscaling`` range, never both
explicitly; custom resource names never shadow Ray's built-ins (``CPU``, ``GPU``, ``memory``);
label keys and selector values follow Ray's (Kubernetes-style) syntax. Graceful drain is Serve's:
a stopping replica leaves every handle's routing set at once, Serve waits (polling every
``drain.wait_loop_s``) until its ongoing requests finish, at most ``drain.timeout_s``, then awaits
the replica's async ``__del__`` and kills it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

RAY_BUILTIN_RESOURCES = frozenset({"CPU", "GPU", "memory", "object_store_memory"})
_NAME = r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
_LABEL_KEY = re.compile(rf"^([a-z0-9]([-a-z0-9.]{{0,251}}[a-z0-9])?/)?{_NAME}$")
_LABEL_VALUE = re.compile(rf"^({_NAME})?$")
_SELECTOR = re.compile(r"^(?P<neg>!)?(?:in\((?P<set>[^()]*)\)|(?P<one>[^()!,]*))$")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class AutoscalingSection(_Strict):
    """Serve's ``autoscaling_config`` for one pool (only the knobs worth setting per pool)."""

    min_replicas: int = Field(default=1, ge=1)  # ≥ 1: /ready asks every pool, the KV hand-off needs a decoder
    max_replicas: int = Field(ge=1)
    initial_replicas: int | None = Field(default=None, ge=1)
    target_ongoing_requests: float | None = Field(default=None, gt=0)  # None: Serve's default (2)
    upscale_delay_s: float | None = Field(default=None, ge=0)
    downscale_delay_s: float | None = Field(default=None, ge=0)

    @model_validator(mode="after")
    def _ordered(self) -> AutoscalingSection:
        start = self.initial_replicas if self.initial_replicas is not None else self.min_replicas
        if not self.min_replicas <= start <= self.max_replicas:
            raise ValueError(f"autoscaling needs min_replicas <= initial_replicas <= max_replicas, got "
                             f"{self.min_replicas} <= {start} <= {self.max_replicas}")
        return self

    def serve_config(self) -> dict[str, Any]:
        """Serve's ``autoscaling_config`` (a pool's section adds its policy: `cluster.autoscaling`)."""
        return self.model_dump(exclude_none=True)


class DrainSection(_Strict):
    """Serve's graceful shutdown for one deployment (see the module docstring)."""

    wait_loop_s: float = Field(default=0.5, gt=0)  # graceful_shutdown_wait_loop_s (Serve's default: 2)
    timeout_s: float = Field(default=60.0, gt=0)  # graceful_shutdown_timeout_s: the longest stream it waits for


class PlacementSection(_Strict):
    """Which nodes may host a deployment's replicas (all of them must match)."""

    resources: dict[str, float] = Field(default_factory=dict)  # Ray custom resources per replica
    label_selector: dict[str, str] = Field(default_factory=dict)  # Ray node labels (``ray start --labels``)
    max_replicas_per_node: int | None = Field(default=None, ge=1)

    @field_validator("resources")
    @classmethod
    def _custom_resources(cls, v: dict[str, float]) -> dict[str, float]:
        for name, amount in v.items():
            if not name or name in RAY_BUILTIN_RESOURCES:
                raise ValueError(f"{name!r} is not a custom resource name "
                                 f"(set num_cpus / num_gpus for {', '.join(sorted(RAY_BUILTIN_RESOURCES))})")
            if not amount > 0 or (amount > 1 and amount != int(amount)):
                raise ValueError(f"{name}: Ray takes a fraction in (0, 1] or a whole number, got {amount}")
        return v

    @field_validator("label_selector")
    @classmethod
    def _selector(cls, v: dict[str, str]) -> dict[str, str]:
        for key, expr in v.items():
            if not _LABEL_KEY.match(key):
                raise ValueError(f"{key!r} is not a valid label key")
            parse_selector(expr)  # raises ValueError naming the accepted forms
        return v


class Scaling(Protocol):
    """What placement reads of one deployment's section (``router``, ``prefill``, ``decode``)."""

    @property
    def num_replicas(self) -> int: ...
    @property
    def num_cpus(self) -> float: ...
    @property
    def placement(self) -> PlacementSection: ...
    @property
    def autoscaling(self) -> AutoscalingSection | None: ...
    @property
    def drain(self) -> DrainSection: ...


def check_scaling(name: str, section: Scaling, num_replicas_set: bool) -> None:
    """A fixed ``num_replicas`` (set explicitly) and an ``autoscaling`` range exclude each other."""
    if section.autoscaling is not None and num_replicas_set:
        raise ValueError(f"{name}: set num_replicas or autoscaling, not both (autoscaling.initial_replicas "
                         "sets the starting count)")


def max_replicas(section: Scaling) -> int:
    """The most replicas a deployment may run (what the cluster must have room for)."""
    return section.autoscaling.max_replicas if section.autoscaling is not None else section.num_replicas


def parse_selector(expr: str) -> tuple[bool, frozenset[str]]:
    """A label selector value → (negated, allowed values): ``v``, ``!v``, ``in(a,b)``, ``!in(a,b)``."""
    m = _SELECTOR.match(expr.strip())
    values = [] if m is None else [s.strip() for s in (m["set"] if m["set"] is not None else m["one"]).split(",")]
    if m is None or not values or any(not s or not _LABEL_VALUE.match(s) for s in values):
        raise ValueError(f"label selector {expr!r}: expected 'value', '!value', 'in(a,b)' or '!in(a,b)'")
    return bool(m["neg"]), frozenset(values)


def selector_matches(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    for key, expr in selector.items():
        negated, values = parse_selector(expr)
        if (labels.get(key) in values) == negated:
            return False
    return True


# ---- Serve options ---------------------------------------------------------------------------

def serve_options(section: Scaling) -> dict[str, Any]:
    """``Deployment.options`` keywords for replica count, autoscaling, spread and drain."""
    opts: dict[str, Any] = {
        "graceful_shutdown_wait_loop_s": section.drain.wait_loop_s,
        "graceful_shutdown_timeout_s": section.drain.timeout_s,
    }
    if section.autoscaling is not None:
        opts["num_replicas"] = None  # Serve refuses a fixed count next to an autoscaling_config
        opts["autoscaling_config"] = section.autoscaling.serve_config()
    else:
        opts["num_replicas"] = section.num_replicas
    if section.placement.max_replicas_per_node is not None:
        opts["max_replicas_per_node"] = section.placement.max_replicas_per_node
    return opts


def actor_placement(placement: PlacementSection) -> dict[str, Any]:
    """The ``ray_actor_options`` entries that pin a replica to its node group."""
    opts: dict[str, Any] = {}
    if placement.resources:
        opts["resources"] = dict(placement.resources)
    if placement.label_selector:
        opts["label_selector"] = dict(placement.label_selector)
    return opts


# ---- capacity check --------------------------------------------------------------------------

@dataclass(frozen=True)
class Demand:
    """One deployment's replicas and what each asks Ray for (``CPU``/``GPU`` plus custom resources)."""

    deployment: str
    replicas: int
    resources: Mapping[str, float]
    label_selector: Mapping[str, str] = field(default_factory=dict)
    max_per_node: int | None = None


@dataclass(frozen=True)
class NodeGroup:
    """``count`` identical Ray nodes (a KubeRay worker group at its maxReplicas, a set of ``ray start``s)."""

    name: str
    count: int
    resources: Mapping[str, float]
    labels: Mapping[str, str] = field(default_factory=dict)


@dataclass
class Fit:
    placed: dict[str, dict[str, int]]  # deployment → node group → replicas
    problems: list[str]

    @property
    def ok(self) -> bool:
        return not self.problems


def demand(name: str, section: Scaling, num_gpus: float = 0.0) -> Demand:
    """What one deployment needs at its maximum replica count."""
    p = section.placement
    res = {"CPU": float(section.num_cpus), **({"GPU": float(num_gpus)} if num_gpus else {}), **p.resources}
    return Demand(name, max_replicas(section), res, dict(p.label_selector), p.max_replicas_per_node)


def _eligible(d: Demand, g: NodeGroup) -> bool:
    return selector_matches(d.label_selector, g.labels) and all(
        g.resources.get(k, 0.0) + 1e-9 >= v for k, v in d.resources.items() if v > 0)


def pack(wanted: Sequence[Demand], groups: Sequence[NodeGroup]) -> Fit:
    """First-fit every replica onto the nodes, most constrained deployment first."""
    nodes = [(g, dict(g.resources), {d.deployment: 0 for d in wanted}) for g in groups for _ in range(g.count)]
    placed: dict[str, dict[str, int]] = {d.deployment: {} for d in wanted}
    problems: list[str] = []
    order = sorted(wanted, key=lambda d: sum(g.count for g in groups if _eligible(d, g)))
    for d in order:
        if not any(_eligible(d, g) for g in groups):
            problems.append(f"{d.deployment}: no node group offers {_fmt(d.resources)}"
                            f"{f' with labels {dict(d.label_selector)}' if d.label_selector else ''}")
            continue
        for i in range(d.replicas):
            for g, free, counts in nodes:
                if (_eligible(d, g) and all(free.get(k, 0.0) + 1e-9 >= v for k, v in d.resources.items())
                        and (d.max_per_node is None or counts[d.deployment] < d.max_per_node)):
                    for k, v in d.resources.items():
                        free[k] = free.get(k, 0.0) - v
                    counts[d.deployment] += 1
                    placed[d.deployment][g.name] = placed[d.deployment].get(g.name, 0) + 1
                    break
            else:
                hosts = sorted({g.name for g in groups if _eligible(d, g)})
                problems.append(f"{d.deployment}: only {i} of {d.replicas} replicas fit (each needs "
                                f"{_fmt(d.resources)}; groups that can host it: {', '.join(hosts)})")
                break
    return Fit(placed, problems)


def _fmt(resources: Mapping[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(resources.items()) if not math.isclose(v, 0)) + "}"
