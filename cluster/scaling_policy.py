"""The ``policy: objectives`` autoscaling decision: a pool's replica count from one signal its replicas
report, with a hysteresis band.

Owns: `Band` (the signal's name and its two thresholds), `pool_signal` (the pool's value: the mean over
its running replicas), `target_replicas` (the pure decision) and `ThresholdPolicy`, the class Serve's
controller instantiates once per deployment (``AutoscalingConfig.policy``: ``policy_function`` this
class, ``policy_kwargs`` a `Band`'s fields) and calls on every autoscaling tick with its
``AutoscalingContext``. The signals are what the replicas' ``record_autoscaling_stats`` return
(`cluster.autoscaling.scaling_signals`, from their own load reports): a prefill pool scales on its
queue wait, a decode pool on its KV use.

The decision: above ``up``, at least one replica more than are running, or as many as bring the mean
back to ``up`` if the load spread evenly (running × signal / up); below ``down``, one fewer; in the
band between, the current target holds (so a pool does not flap around one threshold). Never below
``min_replicas`` nor above ``max_replicas``; no signal yet (replicas starting, none reporting) holds
the target. Serve then applies its own ``upscale_delay_s`` / ``downscale_delay_s`` (a decision must
persist that long) and its bounds, as for its default policy.

Invariants: this module imports the standard library only. Serve pickles the policy by value into its
controller, which may not be able to import pdserve (`tests/cluster/test_scaling_policy.py` checks).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Band:
    """Scale up above ``up``, down below ``down`` (``down < up``), on the signal named ``metric``."""

    metric: str
    up: float
    down: float

    def __post_init__(self) -> None:
        if not 0 <= self.down < self.up:
            raise ValueError(f"{self.metric}: needs 0 <= down < up, got down={self.down}, up={self.up}")

    def kwargs(self) -> dict[str, Any]:
        """``AutoscalingPolicy.policy_kwargs`` (JSON values) for `ThresholdPolicy`."""
        return asdict(self)


def pool_signal(values: Mapping[Any, float], running: Iterable[Any]) -> float | None:
    """The mean of the running replicas' values; None when none of them reported one."""
    seen = [float(values[r]) for r in running if r in values]
    return sum(seen) / len(seen) if seen else None


def target_replicas(running: int, target: int, signal: float | None, band: Band,
                    min_replicas: int, max_replicas: int) -> int:
    """The pool's replica count for ``signal`` (see the module docstring); ``running``: replicas
    serving now, ``target``: the count Serve aims at (above ``running`` while replicas start)."""
    if signal is None or running == 0:
        want = target
    elif signal > band.up:
        want = max(target, running + 1, math.ceil(running * signal / band.up))
    elif signal < band.down:
        want = min(target, running - 1)
    else:
        want = target
    return max(min_replicas, min(max_replicas, want))


class ThresholdPolicy:
    """Serve's custom autoscaling policy over one `Band` (built by Serve with ``policy_kwargs``)."""

    def __init__(self, metric: str, up: float, down: float) -> None:
        self.band = Band(metric, up, down)

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:
        """``ctx``: Serve's ``AutoscalingContext`` (typed ``Any``: this module imports no Ray)."""
        per_replica = (ctx.aggregated_metrics or {}).get(self.band.metric, {})
        signal = pool_signal(per_replica, ctx.running_replicas)
        want = target_replicas(ctx.current_num_replicas, ctx.target_num_replicas, signal, self.band,
                               ctx.capacity_adjusted_min_replicas, ctx.capacity_adjusted_max_replicas)
        return want, {}  # no state of its own: Serve keeps its delay counters beside it
