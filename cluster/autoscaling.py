"""Autoscaling the pools on their own load (``autoscaling.policy: objectives``): the YAML keys, the
signals each replica reports, and what Serve is handed.

Owns:
- `PrefillAutoscaling` / `DecodeAutoscaling`: a pool's ``autoscaling:`` section, Serve's keys
  (`cluster.placement.AutoscalingSection`) plus ``policy`` (``requests``: Serve's default, on ongoing
  requests; ``objectives``: on the signal below) and the signal's two thresholds. A prefill pool
  scales on its queue wait (seconds a new prompt waits for the prompts queued before it: what its
  TTFT objective spends before any forward), a decode pool on its KV use (the fraction of blocks
  held: past it requests wait for admission or are preempted, which is what spends TPOT);
- `scaling_signals`: those signals from one replica's `LoadReport` (the report its ``load()``
  already gives the router: no second stats path), and `with_scaling_signals`, the replica class
  whose ``record_autoscaling_stats`` returns them (Serve aggregates them per replica over
  ``look_back_period_s`` for the policy);
- `serve_autoscaling`: the ``autoscaling_config`` a section gives Serve, with
  `cluster.scaling_policy.ThresholdPolicy` and its `Band` as the custom policy;
- `ray_lacks_custom_policies`: what the installed Ray lacks for this, if anything.

Invariants: ``policy: objectives`` is refused, naming it, where the installed Ray cannot run a custom
policy on replica-reported metrics; a threshold is refused unless ``policy: objectives`` reads it, and
``target_ongoing_requests`` is refused with it (that policy does not read it); ``down < up``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Literal, TypeVar

from pydantic import Field, model_validator

from cluster.placement import AutoscalingSection
from cluster.scaling_policy import Band, ThresholdPolicy
from engine.load_report import LoadReport

QUEUE_WAIT = "queue_wait_s"  # prefill: outstanding prompt tokens at the replica's prefill rate
KV_USE = "kv_use"  # the fraction of the replica's KV blocks in use

POLICY_FUNCTION = f"{ThresholdPolicy.__module__}:{ThresholdPolicy.__name__}"

T = TypeVar("T")


def scaling_signals(report: LoadReport) -> dict[str, float]:
    """The autoscaling signals of one replica's report. A prefill replica's queue wait is its
    outstanding tokens at its mean prefill rate since start; absent while it has queued tokens but no
    forward yet to measure the rate by."""
    out: dict[str, float] = {}
    if report.kv_blocks_total > 0:
        out[KV_USE] = 1.0 - report.kv_blocks_free / report.kv_blocks_total
    if report.role == "prefill":
        if report.outstanding_tokens == 0:
            out[QUEUE_WAIT] = 0.0
        elif report.prefill_tokens > 0 and report.prefill_seconds > 0:
            out[QUEUE_WAIT] = report.outstanding_tokens * report.prefill_seconds / report.prefill_tokens
    return out


def ray_lacks_custom_policies() -> str | None:
    """What the installed Ray Serve lacks to scale a deployment on its replicas' own metrics (a
    custom ``AutoscalingConfig.policy`` class with ``policy_kwargs``, an ``AutoscalingContext`` with
    ``aggregated_metrics``, replicas' ``record_autoscaling_stats``); None when it has all three."""
    try:
        from ray.serve._private.replica import UserCallableWrapper
        from ray.serve.config import AutoscalingConfig, AutoscalingContext, AutoscalingPolicy
    except ImportError as e:
        return f"ray.serve has no custom autoscaling policies ({e})"
    if "policy" not in AutoscalingConfig.model_fields or "policy_kwargs" not in AutoscalingPolicy.model_fields:
        return "ray.serve.config.AutoscalingConfig takes no custom policy class with policy_kwargs"
    if not hasattr(AutoscalingContext, "aggregated_metrics"):
        return "ray.serve.config.AutoscalingContext carries no replica metrics (aggregated_metrics)"
    if not hasattr(UserCallableWrapper, "call_record_autoscaling_stats"):
        return "Serve replicas do not report record_autoscaling_stats"
    return None


class _PoolAutoscaling(AutoscalingSection):
    """Serve's keys plus ``policy`` and one signal's thresholds (named by the subclass)."""

    METRIC: ClassVar[str]
    UP: ClassVar[str]  # the subclass's field names of its two thresholds
    DOWN: ClassVar[str]

    policy: Literal["requests", "objectives"] = "requests"

    def band(self) -> Band | None:
        """The policy's band under ``policy: objectives``; None under Serve's own."""
        if self.policy != "objectives":
            return None
        return Band(self.METRIC, getattr(self, self.UP), getattr(self, self.DOWN))

    @model_validator(mode="after")
    def _policy_keys(self) -> _PoolAutoscaling:
        thresholds = sorted({self.UP, self.DOWN} & self.model_fields_set)
        if self.policy != "objectives":
            if thresholds:
                raise ValueError(f"{', '.join(thresholds)}: read only with policy: objectives")
            return self
        if self.target_ongoing_requests is not None:
            raise ValueError("target_ongoing_requests: policy: objectives scales on "
                             f"{self.METRIC}, not on ongoing requests; drop one of them")
        if not getattr(self, self.DOWN) < getattr(self, self.UP):
            raise ValueError(f"{self.DOWN} must be below {self.UP}, got {getattr(self, self.DOWN)} and "
                             f"{getattr(self, self.UP)}")
        if (lacks := ray_lacks_custom_policies()) is not None:
            raise ValueError(f"policy: objectives needs a Ray Serve that scales on replicas' own metrics: {lacks}")
        return self

    def serve_config(self) -> dict[str, Any]:
        return serve_autoscaling(self)


class PrefillAutoscaling(_PoolAutoscaling):
    METRIC = QUEUE_WAIT
    UP = "queue_wait_up_s"
    DOWN = "queue_wait_down_s"

    queue_wait_up_s: float = Field(default=1.0, gt=0)  # objectives: more replicas above this mean wait
    queue_wait_down_s: float = Field(default=0.1, ge=0)  # objectives: one fewer below it


class DecodeAutoscaling(_PoolAutoscaling):
    METRIC = KV_USE
    UP = "kv_use_up"
    DOWN = "kv_use_down"

    kv_use_up: float = Field(default=0.8, gt=0, le=1)  # objectives: more replicas above this mean KV use
    kv_use_down: float = Field(default=0.3, ge=0, lt=1)  # objectives: one fewer below it


def serve_autoscaling(section: _PoolAutoscaling) -> dict[str, Any]:
    """The pool's ``autoscaling_config`` for ``Deployment.options`` (Serve's keys as they are; under
    ``policy: objectives`` the custom policy, which Serve imports and pickles at deploy time)."""
    own = {"policy", section.UP, section.DOWN}
    config = section.model_dump(exclude_none=True, exclude=own)
    band = section.band()
    if band is not None:
        config["policy"] = {"policy_function": POLICY_FUNCTION, "policy_kwargs": band.kwargs()}
    return config


def with_scaling_signals(cls: type[T], section: AutoscalingSection | None) -> type[T]:
    """``cls`` as it is, or under ``policy: objectives`` a subclass whose ``record_autoscaling_stats``
    returns `scaling_signals` of its ``load()`` (built at run time, so cloudpickle ships it by value
    with the base class by reference)."""
    if not isinstance(section, _PoolAutoscaling) or section.band() is None:
        return cls

    async def record_autoscaling_stats(self: Any) -> Mapping[str, float]:
        return scaling_signals(await self.load())

    namespace = {"record_autoscaling_stats": record_autoscaling_stats, "__doc__": cls.__doc__}
    return type(cls.__name__, (cls,), namespace)
