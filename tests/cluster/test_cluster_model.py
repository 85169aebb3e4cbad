"""ClusterConfig's model fields: hub ids as names, int8 weights and per-pool dtypes reaching the engine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cluster.config import ClusterConfig, ConfigError, Environment
from engine.config import fast_dtype

pytestmark = pytest.mark.timeout(60)

NO_ENV = Environment()
DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


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


def test_int8_weights_reach_both_pools() -> None:
    cfg = config(engine={"quantization": "int8"})
    assert cfg.prefill_worker_config().engine.quantization == "int8"
    assert cfg.decode_worker_config().engine.quantization == "int8"
    assert config().decode_worker_config().engine.quantization is None
    colocated = config(mode="colocated", engine={"quantization": "int8"})
    assert colocated.decode_worker_config().engine.quantization == "int8"
    with pytest.raises(ConfigError, match=r"engine\.quantization"):
        config(engine={"quantization": "int4"})


def test_a_pool_dtype_overrides_the_engines() -> None:
    cfg = config(engine={"dtype": "float32"}, prefill={"dtype": "fp32"}, decode={"dtype": "float32"})
    assert cfg.prefill_worker_config().engine.dtype == "fp32"
    assert cfg.decode_worker_config().engine.dtype == "float32"
    cfg = config(mode="colocated", engine={"dtype": "float32"}, decode={"dtype": "bf16"})
    assert cfg.decode_worker_config().engine.torch_dtype == torch.bfloat16
    cfg = config(engine={"dtype": "auto"}, prefill={"dtype": fast_dtype("cpu")})  # auto as replicas resolve it
    assert cfg.prefill_worker_config().engine.dtype == cfg.decode_worker_config().engine.dtype
    with pytest.raises(ConfigError, match=r"decode\.dtype: unknown dtype 'bf17'"):
        config(decode={"dtype": "bf17"})


@pytest.mark.parametrize(("args", "fields"), [
    ({"prefill": {"dtype": "bf16"}, "decode": {"dtype": "float32"}},
     ("prefill.dtype='bf16'", "decode.dtype='float32'")),
    ({"engine": {"dtype": "float32"}, "prefill": {"dtype": "float16"}},
     ("prefill.dtype='float16'", "engine.dtype (for decode)='float32'")),
    ({"engine": {"dtype": "bfloat16"}, "decode": {"dtype": "fp32"}},
     ("engine.dtype (for prefill)='bfloat16'", "decode.dtype='fp32'")),
])
def test_disaggregated_pools_must_agree_on_the_kv_dtype(args: dict[str, object], fields: tuple[str, str]) -> None:
    with pytest.raises(ConfigError) as e:
        config(**args)
    msg = str(e.value)
    assert all(f in msg for f in fields) and "KV dtypes" in msg and "disaggregated" in msg
    config(mode="colocated", **args)  # one pool: nothing to agree with


def test_the_shipped_yamls_keep_one_dtype_and_no_quantization() -> None:
    for name in ("local.yaml", "local-colocated.yaml", "gpu.yaml"):
        cfg = ClusterConfig.from_yaml(DEPLOY / name, NO_ENV)
        assert cfg.decode_worker_config().engine.quantization is None
        assert cfg.prefill_worker_config().engine.dtype == cfg.decode_worker_config().engine.dtype
