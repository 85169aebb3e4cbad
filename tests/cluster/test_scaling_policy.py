"""`cluster.scaling_policy`: the pure decision on synthetic signals, the same policy inside Serve's own
wrapper (delays, bounds) with a real ``AutoscalingContext``, and the policy as Serve pickles it, loaded
in a process that cannot import pdserve (as the Serve controller may not)."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from ray.serve._private.autoscaling_state import _resolve_policy_callable
from ray.serve._private.common import DeploymentID, ReplicaID
from ray.serve.autoscaling_policy import _apply_autoscaling_config
from ray.serve.config import AutoscalingConfig, AutoscalingContext, AutoscalingPolicy

from cluster import scaling_policy
from cluster.autoscaling import POLICY_FUNCTION
from cluster.scaling_policy import Band, ThresholdPolicy, pool_signal, target_replicas

pytestmark = pytest.mark.timeout(60)

WAIT = Band("queue_wait_s", up=1.0, down=0.2)


@pytest.mark.parametrize(("running", "target", "signal", "want"), [
    (2, 2, 0.5, 2),  # inside the band: hold
    (2, 2, 1.0, 2),  # at ``up``: not above it
    (2, 2, 0.2, 2),  # at ``down``: not below it
    (2, 2, 1.2, 3),  # above: one more at least
    (2, 2, 3.1, 7),  # far above: as many as bring the mean back to ``up`` (2 x 3.1 / 1.0, rounded up)
    (2, 3, 1.2, 3),  # one already starting: not another for the same excess
    (2, 2, 0.1, 1),  # below: one fewer
    (3, 2, 0.1, 2),  # already going down: hold the lower target
    (2, 2, None, 2),  # no signal yet: hold
    (0, 1, 5.0, 1),  # nothing running: hold (Serve's cold start brings the first up)
])
def test_the_decision_on_synthetic_signals(running: int, target: int, signal: float | None, want: int) -> None:
    assert target_replicas(running, target, signal, WAIT, 1, 8) == want


@pytest.mark.parametrize(("running", "target", "signal", "want"), [
    (4, 4, 9.0, 5),  # above: capped at max_replicas
    (1, 1, 0.0, 1),  # below: never under min_replicas
    (6, 6, 0.5, 5),  # a target beyond a lowered max comes back inside it
])
def test_the_decision_stays_within_min_and_max(running: int, target: int, signal: float, want: int) -> None:
    assert target_replicas(running, target, signal, WAIT, 1, 5) == want


def test_hysteresis_a_signal_that_crosses_up_then_settles_in_the_band_does_not_flap() -> None:
    replicas, seen = 2, []
    for signal in (1.5, 0.9, 0.5, 0.3, 0.9, 0.5, 0.15, 0.5):
        replicas = target_replicas(replicas, replicas, signal, WAIT, 1, 8)
        seen.append(replicas)
    assert seen == [3, 3, 3, 3, 3, 3, 2, 2]


def test_the_pool_signal_is_the_running_replicas_mean() -> None:
    assert pool_signal({"a": 1.0, "b": 3.0, "gone": 50.0}, ["a", "b", "new"]) == 2.0
    assert pool_signal({"gone": 50.0}, ["a"]) is None


def test_a_band_needs_down_below_up() -> None:
    with pytest.raises(ValueError, match="kv_use: needs 0 <= down < up"):
        Band("kv_use", up=0.5, down=0.5)


def _ctx(config: AutoscalingConfig, per_replica: dict[str, float], target: int) -> AutoscalingContext:
    dep = DeploymentID(name="prefill", app_name="pdserve")
    replicas = [ReplicaID(unique_id=u, deployment_id=dep) for u in per_replica]
    return AutoscalingContext(
        deployment_id=dep, deployment_name="prefill", app_name="pdserve", current_num_replicas=len(replicas),
        target_num_replicas=target, running_replicas=replicas, total_num_requests=3.0, total_queued_requests=0.0,
        aggregated_metrics={"queue_wait_s": dict(zip(replicas, per_replica.values(), strict=True))},
        raw_metrics={}, capacity_adjusted_min_replicas=config.min_replicas,
        capacity_adjusted_max_replicas=config.max_replicas, policy_state={}, last_scale_up_time=None,
        last_scale_down_time=None, current_time=0.0, config=config)


def test_serve_runs_the_policy_it_is_handed_through_its_own_wrapper() -> None:
    """The config `cluster.autoscaling` writes, resolved and wrapped exactly as Serve's controller does
    (`AutoscalingState`): the class built once with its kwargs, then Serve's delays and factors."""
    config = AutoscalingConfig(min_replicas=1, max_replicas=4, upscale_delay_s=0, downscale_delay_s=0,
                               policy=AutoscalingPolicy(policy_function=POLICY_FUNCTION, policy_kwargs=WAIT.kwargs()))
    policy = _apply_autoscaling_config(_resolve_policy_callable(config.policy))
    assert policy(_ctx(config, {"r1": 2.5, "r2": 1.5}, 2))[0] == 4  # mean 2 s over a 1 s threshold
    assert policy(_ctx(config, {"r1": 0.5, "r2": 0.7}, 2))[0] == 2  # in the band
    assert policy(_ctx(config, {"r1": 0.0, "r2": 0.1}, 2))[0] == 1
    slow = AutoscalingConfig(**(config.model_dump(exclude={"policy"}) | {"downscale_delay_s": 600}),
                             policy=config.policy)
    held = _apply_autoscaling_config(_resolve_policy_callable(slow.policy))
    assert held(_ctx(slow, {"r1": 0.0, "r2": 0.1}, 2))[0] == 2  # Serve's own delay still applies


def test_the_policy_module_imports_the_standard_library_only() -> None:
    tree = ast.parse(Path(scaling_policy.__file__).read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {(n.module or "").split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert imported <= set(sys.stdlib_module_names) | {"__future__"}, imported


def test_the_pickled_policy_runs_where_pdserve_cannot_be_imported(tmp_path: Path) -> None:
    blob = tmp_path / "policy.pkl"
    policy = AutoscalingPolicy(policy_function=POLICY_FUNCTION, policy_kwargs=WAIT.kwargs())
    pickled = policy.get_serialized_policy_def()
    assert pickled
    blob.write_bytes(pickled)
    script = textwrap.dedent(f"""
        import sys, types
        for name in ("cluster", "engine", "router", "prefill_worker", "decode_worker", "kv_transfer"):
            sys.modules[name] = None  # any import of pdserve fails
        from ray import cloudpickle
        policy = cloudpickle.loads(open({str(blob)!r}, "rb").read())(**{WAIT.kwargs()!r})
        ctx = types.SimpleNamespace(aggregated_metrics={{"queue_wait_s": {{"a": 2.0}}}}, running_replicas=["a"],
                                    current_num_replicas=1, target_num_replicas=1,
                                    capacity_adjusted_min_replicas=1, capacity_adjusted_max_replicas=4)
        print(policy(ctx)[0])
    """)
    out = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True,
                         timeout=50, env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "2"


def test_the_adapter_reads_its_metric_only() -> None:
    ctx: Any = type("Ctx", (), dict(aggregated_metrics={"kv_use": {"a": 0.99}}, running_replicas=["a"],
                                    current_num_replicas=1, target_num_replicas=1,
                                    capacity_adjusted_min_replicas=1, capacity_adjusted_max_replicas=4))()
    assert ThresholdPolicy(**WAIT.kwargs())(ctx) == (1, {})  # no queue_wait_s reported: hold
    assert ThresholdPolicy("kv_use", up=0.8, down=0.3)(ctx) == (2, {})
