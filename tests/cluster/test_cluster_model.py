"""ClusterConfig's model fields: hub ids as names, int8 weights and per-pool dtypes reaching the engine."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.config import ClusterConfig, Environment

pytestmark = pytest.mark.timeout(60)

NO_ENV = Environment()


def config(**args: object) -> ClusterConfig:
    return ClusterConfig.from_args(args, NO_ENV)


def test_a_hub_id_is_served_under_its_whole_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = config(model="Qwen/Qwen3-0.6B")
    assert cfg.name == "Qwen/Qwen3-0.6B" == cfg.router_config().served_model_name
    assert cfg.prefill_worker_config().model == cfg.decode_worker_config().model == "Qwen/Qwen3-0.6B"
    assert config(model="Qwen/Qwen3-0.6B", served_model_name="qwen").name == "qwen"
    assert config(model="/models/my-llama").name == "my-llama"
    assert config(model="/models/tiny.Q8_0.gguf").name == "tiny.Q8_0"
    (tmp_path / "models" / "local").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert config(model="models/local").name == "local"  # a folder of that shape is a path
