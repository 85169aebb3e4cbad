"""The benchmark YAMLs (deploy/bench-*.yaml): per-pool threads and CPU pinning reach the engines."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.config import ClusterConfig, Environment

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def _cfg(name: str) -> ClusterConfig:
    return ClusterConfig.from_yaml(DEPLOY / f"bench-{name}.yaml", Environment())


def test_disaggregated_pins_prefill_and_decode_to_one_core_each() -> None:
    cfg = _cfg("disaggregated")
    prefill, decode = cfg.prefill_worker_config().engine, cfg.decode_worker_config().engine
    assert (prefill.cpu_affinity, prefill.num_threads) == ((0,), 1)
    assert (decode.cpu_affinity, decode.num_threads) == ((1,), 1)


@pytest.mark.parametrize(("name", "chunk"), [("colocated", 0), ("colocated-chunked", 256)])
def test_colocated_engine_gets_both_cores(name: str, chunk: int) -> None:
    worker = _cfg(name).decode_worker_config()
    assert (worker.engine.cpu_affinity, worker.engine.num_threads) == ((0, 1), 2)
    assert worker.prefill_chunk_size == chunk


def test_pool_threads_override_the_engine_section_and_default_to_it() -> None:
    args = {"engine": {"num_threads": 2}, "prefill": {"num_threads": 1}}
    cfg = ClusterConfig.from_args(args, Environment())
    assert cfg.prefill_worker_config().engine.num_threads == 1
    assert cfg.decode_worker_config().engine.num_threads == 2
    assert cfg.decode_worker_config().engine.cpu_affinity == ()
