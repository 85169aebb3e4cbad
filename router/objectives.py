"""Service-level objectives: a TTFT and a TPOT objective per request class, and the class of a request.

Owns: `SLOClass` (a class's name, how a request falls into it, its two objectives), `Objectives` (the
ordered set of classes, built by `cluster.config.ClusterConfig.objectives` from the YAML's
``objectives:`` section), `Objectives.classify` and `attained`. Goodput is the rate of requests that
attain both objectives of their class (DistServe's measure); the path decision
(`router.path_policy`), the prefill planner's deadlines (`engine.prefill_planner`) and the capacity
planner (`cluster.planner`) all read the objectives from here.

A request falls into a class in one of two ways: by name (the request names a class; a name no class
has is refused, naming the known ones) or, naming none, by prompt length: the length classes sorted
by ``max_prompt_tokens``, the first whose bound holds the prompt, else the one class without a bound
(the catch-all). A class may be ``named_only``: it is never chosen by length.

Invariants (checked at construction): names are unique; among the length classes, bounds are
distinct and exactly one has no bound, so every request has exactly one class; objectives are
positive. An empty `Objectives` means no objectives: `classify` answers None and nothing is judged.
Pure: no clock, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SLOClass:
    """One request class and its objectives (seconds)."""

    name: str
    ttft_s: float  # time to first token, from arrival at the router
    tpot_s: float  # mean time per output token after the first
    max_prompt_tokens: int | None = None  # a length class holds prompts up to this; None: the catch-all
    named_only: bool = False  # chosen only when a request names it

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("an objective class needs a name")
        if not (self.ttft_s > 0 and self.tpot_s > 0):
            raise ValueError(f"class {self.name!r}: ttft_s and tpot_s must be positive, got "
                             f"{self.ttft_s}, {self.tpot_s}")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise ValueError(f"class {self.name!r}: max_prompt_tokens must be >= 1, got {self.max_prompt_tokens}")
        if self.named_only and self.max_prompt_tokens is not None:
            raise ValueError(f"class {self.name!r}: a named_only class has no max_prompt_tokens")

    def ttft_deadline(self, arrival_s: float) -> float:
        """When a request of this class that arrived at ``arrival_s`` must have its first token."""
        return arrival_s + self.ttft_s


@dataclass(frozen=True)
class Objectives:
    """The classes of a cluster, in configured order; empty: no objectives."""

    classes: tuple[SLOClass, ...] = ()

    def __post_init__(self) -> None:
        names = [c.name for c in self.classes]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"objective classes named more than once: {dup}")
        by_length = [c for c in self.classes if not c.named_only]
        bounds = [c.max_prompt_tokens for c in by_length if c.max_prompt_tokens is not None]
        if len(set(bounds)) != len(bounds):
            raise ValueError(f"objective classes share a max_prompt_tokens: {sorted(bounds)}")
        catch_all = [c.name for c in by_length if c.max_prompt_tokens is None]
        if self.classes and len(catch_all) != 1:
            raise ValueError(
                "objectives need exactly one length class without max_prompt_tokens (the catch-all), "
                f"got {catch_all or 'none'}")

    @property
    def enabled(self) -> bool:
        return bool(self.classes)

    def by_name(self, name: str) -> SLOClass:
        for c in self.classes:
            if c.name == name:
                return c
        raise ValueError(f"unknown objective class {name!r}; expected one of {[c.name for c in self.classes]}")

    def classify(self, prompt_tokens: int, name: str | None = None) -> SLOClass | None:
        """The class of a request: the one it names, else by its prompt length; None without objectives."""
        if not self.classes:
            if name is not None:
                raise ValueError(f"objective class {name!r} named, but no objectives are configured")
            return None
        if name is not None:
            return self.by_name(name)
        bounded = sorted((c for c in self.classes if not c.named_only and c.max_prompt_tokens is not None),
                         key=lambda c: c.max_prompt_tokens or 0)
        for c in bounded:
            if prompt_tokens <= (c.max_prompt_tokens or 0):
                return c
        return next(c for c in self.classes if not c.named_only and c.max_prompt_tokens is None)


def attained(ttft_s: float, tpot_s: float | None, cls: SLOClass) -> bool:
    """Whether a request met both objectives of its class (``tpot_s`` None: one output token, no TPOT)."""
    return ttft_s <= cls.ttft_s and (tpot_s is None or tpot_s <= cls.tpot_s)


def tpot(first_token_s: float, last_token_s: float, output_tokens: int) -> float | None:
    """Mean time per output token after the first; None for a one-token output."""
    if output_tokens < 1:
        raise ValueError(f"output_tokens must be >= 1, got {output_tokens}")
    return None if output_tokens == 1 else (last_token_s - first_token_s) / (output_tokens - 1)
