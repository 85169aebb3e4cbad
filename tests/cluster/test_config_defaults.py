"""One source for every default: an empty YAML builds exactly the components' own default configs.

The YAML sections take their defaults from the dataclasses they feed (`PrefillWorkerConfig`,
`DecodeWorkerConfig`, `EngineConfig`, `KVTransferConfig`, `RouterConfig`, `SchedulerConfig`); a
section default that drifts from its dataclass's fails here. The differences listed are the
cluster's deliberate choices, each stated once in cluster/config.py.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from cluster.config import PREFILL_CPU_BLOCKS, PREFILL_DEPLOYMENT, ClusterConfig, Environment
from decode_worker.config import DecodeWorkerConfig
from decode_worker.scheduler import SchedulerConfig
from engine.config import EngineConfig, fast_dtype
from kv_transfer.config import KVTransferConfig
from prefill_worker.config import PrefillWorkerConfig
from router.config import RouterConfig
from router.path_policy import PathParams

NO_ENV = Environment()


def _differences(built: Any, default: Any) -> dict[str, tuple[Any, Any]]:
    a, b = _flat(asdict(built)), _flat(asdict(default))
    return {k: (a[k], b[k]) for k in a if a[k] != b[k]}


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def test_an_empty_yaml_builds_the_workers_default_configs() -> None:
    cfg = ClusterConfig.from_args({}, NO_ENV)
    secret = cfg.kv.secret
    # deliberate: dtype auto is resolved for the cluster (a bare EngineConfig is the fp32 reference);
    # the KV secret is drawn per cluster; a prefill replica holds blocks only until they are pulled
    # (on a CPU without bf16 arithmetic, auto is fp32 too: no difference then); each pool's largest
    # step (profiled where a KV budget applies) is what its worker runs at most, and its KV budget
    # holds back the transfers' staging memory; a disaggregated decode replica watches the prefill
    # deployment's KV sources (a bare DecodeWorkerConfig watches none); with the per-request path
    # (router.prefill_path: auto) it prefills LOCAL requests, router.path_policy.max_chunk_tokens a step
    # beside its decode rows
    engine = {"engine.dtype": (fast_dtype("cpu"), "float32")} if fast_dtype("cpu") != "float32" else {}
    engine["engine.reserved_memory"] = (KVTransferConfig().max_inflight_bytes, 0)
    kv = {"kv.secret": (secret, "")}
    assert _differences(cfg.prefill_worker_config(), PrefillWorkerConfig()) == {
        **engine, **kv, "engine.num_blocks": (PREFILL_CPU_BLOCKS, EngineConfig().num_blocks),
        "engine.max_step_tokens": (PrefillWorkerConfig().max_batch_tokens, None)}
    assert _differences(cfg.decode_worker_config(), DecodeWorkerConfig()) == {
        **engine, **kv, "engine.max_step_tokens": (EngineConfig().max_num_seqs + PathParams.max_chunk_tokens, None),
        "prefill_deployment": (PREFILL_DEPLOYMENT, None), "local_prefill": (True, False),
        "prefill_chunk_size": (PathParams.max_chunk_tokens, 0)}


def test_an_empty_yaml_builds_the_routers_default_config() -> None:
    cfg = ClusterConfig.from_args({}, NO_ENV)
    # deliberate: the cluster bounds a router's requests in flight by what its decode pool holds
    assert _differences(cfg.router_config(), RouterConfig()) == {
        "max_inflight_requests": (cfg.decode_capacity_per_router(), None)}


def test_the_decode_configs_defaults_are_the_schedulers() -> None:
    sched, worker, engine = SchedulerConfig(), DecodeWorkerConfig(), EngineConfig()
    assert (sched.watermark_blocks, sched.max_swap_blocks) == (worker.watermark_blocks, worker.max_swap_blocks)
    assert sched.max_num_seqs == engine.max_num_seqs


def test_a_drifted_default_is_seen() -> None:
    drifted = PrefillWorkerConfig(max_queue=PrefillWorkerConfig().max_queue + 1)
    assert _differences(drifted, PrefillWorkerConfig()) == {
        "max_queue": (drifted.max_queue, PrefillWorkerConfig().max_queue)}
