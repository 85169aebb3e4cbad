"""ClusterConfig: the shipped YAMLs, environment handling, clear errors, the CLI's config command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from cluster.cli import main
from cluster.config import PREFILL_DEPLOYMENT, ClusterConfig, ConfigError, Environment
from cluster.serve_yaml import application_args
from engine.config import EngineConfig, auto_dtype, checkpoint_dtype, fast_dtype
from engine.engine import log_dtype
from engine.model.config import ModelConfig

pytestmark = pytest.mark.timeout(60)

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
NO_ENV = Environment()


def test_local_yaml() -> None:
    cfg = ClusterConfig.from_yaml(DEPLOY / "local.yaml", NO_ENV)
    assert cfg.mode == "disaggregated" and cfg.kv.transport == "gloo"
    p, d, r = cfg.prefill_worker_config(), cfg.decode_worker_config(), cfg.router_config()
    assert cfg.engine.dtype == "auto" and p.engine.dtype == d.engine.dtype == fast_dtype("cpu")
    assert p.engine.device == "cpu" and p.kv.transport == "gloo"
    assert p.engine.num_blocks == 256 and d.engine.num_blocks == 512 and d.mode == "disaggregated"
    assert p.kv.secret and p.kv.secret == d.kv.secret
    assert d.prefill_deployment == PREFILL_DEPLOYMENT  # decode replicas meet the pool's KV sources at start-up
    assert r.served_model_name == "smollm2-135m-instruct" and r.mode == "disaggregated" and r.api_keys == ()
    assert r.max_model_len == 4096 == p.engine.max_model_len
    assert cfg.total_cpus() <= 2


def test_prefill_path_reaches_the_router_and_the_decode_replicas() -> None:
    """``auto`` (the default): the router decides with the YAML's knobs, decode replicas prefill LOCAL
    requests up to ``max_chunk_tokens`` a step; ``remote``: neither; the always-remote bench layout
    differs from the default one in that key alone."""
    knobs = {"short_prompt_tokens": 40, "min_cached_fraction": 0.75, "tpot_safety": 0.8, "max_chunk_tokens": 96}
    auto = ClusterConfig.from_args({"router": {"path_policy": knobs}}, NO_ENV)
    r, d = auto.router_config(), auto.decode_worker_config()
    assert r.prefill_path == "auto" and d.local_prefill and d.prefill_chunk_size == 96
    p = r.path_policy
    assert (p.short_prompt_tokens, p.min_cached_fraction, p.tpot_safety, p.max_chunk_tokens) == (40, 0.75, 0.8, 96)
    assert d.engine.max_step_tokens == d.engine.max_num_seqs + 96
    remote = ClusterConfig.from_args({"router": {"prefill_path": "remote"}}, NO_ENV)
    assert remote.router_config().prefill_path == "remote" and not remote.decode_worker_config().local_prefill
    assert remote.decode_worker_config().prefill_chunk_size == 0
    assert ClusterConfig.from_yaml(DEPLOY / "local.yaml", NO_ENV).router.prefill_path == "auto"
    bench = ClusterConfig.from_yaml(DEPLOY / "bench-disaggregated.yaml", NO_ENV)
    bench_remote = ClusterConfig.from_yaml(DEPLOY / "bench-disaggregated-remote.yaml", NO_ENV)
    assert bench.router.prefill_path == "auto" and bench_remote.router.prefill_path == "remote"
    assert bench_remote.model_copy(update={"router": bench.router, "kv": bench.kv}) == bench.model_copy(
        update={"kv": bench.kv})


def test_n_is_bounded_by_what_a_decode_replica_runs_at_once() -> None:
    assert ClusterConfig.from_args({}, NO_ENV).router_config().max_choices == 16
    small = ClusterConfig.from_args({"decode": {"max_num_seqs": 4}}, NO_ENV)
    assert small.router_config().max_choices == 4


def test_dtype_auto_resolves_per_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """``auto`` is bf16 where the CPU computes in it, fp32 where bf16 would be emulated, bf16 on CUDA;
    an EngineConfig never keeps the word itself, and a misspelt dtype names the accepted ones."""
    for avx512_bf16, amx, want in ((True, False, "bfloat16"), (False, True, "bfloat16"), (False, False, "float32")):
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda v=avx512_bf16: v)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda v=amx: v)
        assert fast_dtype("cpu") == want
        assert EngineConfig(dtype="auto").dtype == want
    assert fast_dtype("cuda:0") == "bfloat16"
    assert EngineConfig(dtype="float32").dtype == "float32"
    with pytest.raises(ValueError, match="auto"):
        EngineConfig(dtype="fp8")
    with pytest.raises(ValueError, match="fp8"):
        ClusterConfig.from_args({"engine": {"dtype": "fp8"}}, NO_ENV)


def _cpu_bf16(monkeypatch: pytest.MonkeyPatch, fast: bool) -> None:
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: fast)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)


@pytest.mark.parametrize("key", ["torch_dtype", "dtype"])
def test_dtype_auto_keeps_the_checkpoints_where_the_device_runs_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, key: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The stored dtype is read from either key transformers writes (its own config agrees); a bf16
    checkpoint stays bf16 where the CPU computes in it and runs in fp32 (said in the log) where it
    does not; fp16 stays fp16 on CUDA; the cluster resolves ``auto`` with a local folder's dtype."""
    from transformers import LlamaConfig

    written = LlamaConfig(torch_dtype="float16").to_dict()
    assert checkpoint_dtype(written) == torch.float16 == LlamaConfig.from_dict(written).dtype
    for name, want in (("bfloat16", torch.bfloat16), ("float16", torch.float16), ("float32", torch.float32),
                       ("int8", None)):
        assert checkpoint_dtype({key: name}) == want
    assert checkpoint_dtype({}) is None
    cfg = {"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
           "num_hidden_layers": 1, "num_attention_heads": 2, key: "bfloat16"}
    assert ModelConfig.from_hf_dict(cfg).checkpoint_dtype == torch.bfloat16
    for fast, want in ((True, "bfloat16"), (False, "float32")):
        _cpu_bf16(monkeypatch, fast)
        assert auto_dtype("cpu", torch.bfloat16) == want
        assert auto_dtype("cpu", torch.float16) == want  # no fp16 CPU kernels: bf16 where fast, else exact fp32
        assert auto_dtype("cpu", torch.float32) == auto_dtype("cpu", None) == fast_dtype("cpu") == want
        folder = tmp_path / f"model-{fast}"
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(cfg))
        c = ClusterConfig.from_args({"model": str(folder)}, NO_ENV)
        assert c.prefill_worker_config().engine.dtype == c.decode_worker_config().engine.dtype == want
    assert auto_dtype("cuda:0", torch.float16) == "float16"
    assert auto_dtype("cuda:0", torch.bfloat16) == auto_dtype("cuda", None) == "bfloat16"
    with caplog.at_level("INFO", logger="engine.engine"):
        log_dtype(torch.bfloat16, EngineConfig(dtype="float32"))
    assert "stored in bfloat16, computed in float32: this CPU has no bf16 matmul" in caplog.text


def test_colocated_yaml() -> None:
    cfg = ClusterConfig.from_yaml(DEPLOY / "local-colocated.yaml", NO_ENV)
    d = cfg.decode_worker_config()
    assert cfg.mode == "colocated" and d.mode == "colocated" and d.prefill_chunk_size == 512
    assert d.prefill_deployment is None
    assert cfg.router_config().mode == "colocated" and cfg.decode_policy() == "prefix_affinity"
    assert "prefill" not in cfg.redacted()


def test_gpu_yaml() -> None:
    cfg = ClusterConfig.from_yaml(DEPLOY / "gpu.yaml", NO_ENV)
    p, d = cfg.prefill_worker_config(), cfg.decode_worker_config()
    assert cfg.kv.transport == "nccl" and cfg.prefill.num_gpus == 1 and cfg.decode.num_gpus == 1
    assert p.engine.device == d.engine.device == "cuda" and p.engine.dtype == "bfloat16"
    assert cfg.decode_policy() == "least_outstanding_tokens"
    # the KV caches are sized from the budget, each pool profiling its largest step first
    assert p.engine.kv_cache_memory == d.engine.kv_cache_memory == 0.9
    assert p.engine.num_blocks is None and d.engine.num_blocks is None
    # a decode step: its 256 sequences and a LOCAL prompt chunk (router.path_policy.max_chunk_tokens)
    assert p.engine.max_step_tokens == 8192 and d.engine.max_step_tokens == 256 + 512 and d.max_swap_blocks == 4096
    # the budget holds back what the KV transfers stage through
    assert p.engine.reserved_memory == d.engine.reserved_memory == cfg.kv.max_inflight_bytes == 256 << 20


def test_kv_budget_keys_per_engine_and_pool() -> None:
    cfg = ClusterConfig.from_args({"engine": {"kv_cache_memory": 0.9}, "prefill": {"kv_cache_memory": 0.3},
                                   "decode": {"num_blocks": 2048}}, NO_ENV)
    p, d = cfg.prefill_worker_config().engine, cfg.decode_worker_config().engine
    assert (p.kv_cache_memory, p.num_blocks) == (0.3, None)  # a budget on a CPU: no default count
    assert (d.kv_cache_memory, d.num_blocks) == (0.9, 2048)  # checked against the budget at start
    bytes_ = ClusterConfig.from_args({"engine": {"kv_cache_memory": 8 << 30}}, NO_ENV)
    assert bytes_.decode_worker_config().engine.kv_cache_memory == 8 << 30
    colocated = ClusterConfig.from_args({"mode": "colocated", "decode": {"prefill_chunk_size": 512}}, NO_ENV)
    assert colocated.decode_worker_config().engine.max_step_tokens == 512
    whole = ClusterConfig.from_args({"mode": "colocated"}, NO_ENV)
    assert whole.decode_worker_config().engine.max_step_tokens is None  # a whole prompt: max_model_len
    assert whole.decode_worker_config().engine.reserved_memory == 0  # colocated: no transfers


def test_environment_fills_keys_secret_and_cache() -> None:
    env = Environment.read({"PDSERVE_API_KEYS": "a, b,,", "PDSERVE_KV_SECRET": "s3cret",
                            "PDSERVE_MODEL_CACHE": "/cache"})
    assert env == Environment(api_keys=("a", "b"), kv_secret="s3cret", model_cache="/cache")
    cfg = ClusterConfig.from_args({"router": {"api_keys": ["z", "a"]}}, env)
    assert cfg.router.api_keys == ["z", "a", "b"] and cfg.kv.secret == "s3cret"
    assert cfg.model_cache_dir == "/cache" and cfg.prefill_worker_config().model_cache_dir == "/cache"
    configured = ClusterConfig.from_args({"kv": {"secret": "mine"}}, env)
    assert configured.kv.secret == "mine"


def test_random_secret_per_config_and_redaction() -> None:
    a, b = ClusterConfig.from_args({}, NO_ENV), ClusterConfig.from_args({}, NO_ENV)
    assert a.kv.secret and b.kv.secret and a.kv.secret != b.kv.secret and len(a.kv.secret) >= 32
    cfg = ClusterConfig.from_args({"router": {"api_keys": ["k1"]}, "kv": {"secret": "x"}}, NO_ENV)
    shown = json.dumps(cfg.redacted())
    assert "k1" not in shown and '"x"' not in shown and "***" in shown
    assert "k1" not in repr(cfg) and "k1" not in repr(cfg.router_config())


@pytest.mark.parametrize(("args", "needle"), [
    ({"decode": {"num_blockz": 5}}, "decode.num_blockz: unknown key (allowed: num_replicas"),
    ({"modle": "x"}, "modle: unknown key (allowed: model,"),
    ({"kv": {"transport": "nccl"}}, "needs engine.device='cuda'"),
    ({"engine": {"device": "cuda"}, "kv": {"transport": "nccl"}}, "needs decode.num_gpus > 0"),
    ({"engine": {"device": "cuda"}, "decode": {"num_gpus": 1}}, "needs prefill.num_gpus > 0"),
    ({"kv": {"transport": "tcp"}}, "kv.transport"),
    ({"engine": {"dtype": "int3"}}, "unknown dtype"),
    ({"engine": {"device": "tpu"}}, "device must be"),
    ({"prefill": {"num_replicas": 0}}, "prefill.num_replicas"),
    ({"decode": {"prefill_chunk_size": 64}}, "applies to mode='colocated' only"),
    ({"mode": "split"}, "mode"),
    ({"router": {"api_keys": [""]}}, "non-empty"),
    ({"limits": {"max_model_len": 1}}, "limits.max_model_len"),
    ({"engine": {"kv_cache_memory": 1}}, "engine.kv_cache_memory: kv_cache_memory=1 is a byte count below"),
    ({"decode": {"kv_cache_memory": 1.5}}, "decode.kv_cache_memory: kv_cache_memory=1.5: a fraction"),
    ({"engine": {"kv_cache_memroy": 0.9}}, "engine.kv_cache_memroy: unknown key (allowed: device"),
    ({"prefill": {"num_blocks": 0}}, "prefill.num_blocks"),
    ({"router": {"prefill_path": "local"}}, "router.prefill_path"),
    ({"mode": "colocated", "router": {"prefill_path": "remote"}}, "router.prefill_path='remote' needs mode"),
    ({"mode": "colocated", "router": {"path_policy": {"short_prompt_tokens": 8}}}, "router.path_policy applies"),
    ({"router": {"prefill_path": "remote", "path_policy": {"tpot_safety": 0.5}}}, "router.path_policy applies"),
    ({"router": {"path_policy": {"tpot_safety": 1.5}}}, "router.path_policy.tpot_safety"),
    ({"router": {"path_policy": {"max_chunk_tokenz": 5}}}, "router.path_policy.max_chunk_tokenz: unknown key"),
])
def test_bad_configs_say_what_and_where(args: dict[str, object], needle: str) -> None:
    with pytest.raises(ConfigError) as e:
        ClusterConfig.from_args(args, NO_ENV, source="test.yaml")
    assert needle in str(e.value) and str(e.value).startswith("test.yaml: invalid pdserve config")


def test_colocated_ignores_gpu_rules_for_the_missing_prefill_pool() -> None:
    cfg = ClusterConfig.from_args({"mode": "colocated", "engine": {"device": "cuda"},
                                   "decode": {"num_gpus": 1}}, NO_ENV)
    assert cfg.decode_worker_config().engine.device == "cuda"


def test_yaml_file_errors(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("applications: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        application_args(bad)
    bad.write_text("applications:\n  - import_path: other:app\n")
    with pytest.raises(ConfigError, match="exactly one application"):
        application_args(bad)
    with pytest.raises(ConfigError, match="cannot read"):
        application_args(tmp_path / "missing.yaml")


def test_cli_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "--config", str(DEPLOY / "gpu.yaml")]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["kv"]["transport"] == "nccl" and shown["kv"]["secret"] == "***"
    bad = tmp_path / "bad.yaml"
    bad.write_text("applications:\n  - import_path: cluster.app:build_app\n    args: {decode: {x: 1}}\n")
    assert main(["config", "--config", str(bad)]) == 2
    assert "decode.x: unknown key" in capsys.readouterr().err


def test_build_app_is_a_serve_builder_and_builds_without_starting() -> None:
    from ray.serve import Application
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary

    from cluster.app import build_app

    for name in ("local.yaml", "local-colocated.yaml", "gpu.yaml"):
        app = call_user_app_builder_with_args_if_necessary(build_app, application_args(DEPLOY / name))
        assert isinstance(app, Application)


def test_stream_interval_reaches_the_decode_worker_and_is_bounded() -> None:
    cfg = ClusterConfig.from_args({"decode": {"stream_interval": 4}}, NO_ENV)
    assert cfg.decode_worker_config().stream_interval == 4
    assert ClusterConfig.from_args({}, NO_ENV).decode_worker_config().stream_interval == 1
    with pytest.raises(ConfigError, match="stream_interval"):
        ClusterConfig.from_args({"decode": {"stream_interval": 0}}, NO_ENV)


def test_decode_attention_reaches_the_engine_and_is_refused_where_unused() -> None:
    cfg = ClusterConfig.from_args({"engine": {"decode_attention": "sdpa"}}, NO_ENV)
    assert cfg.decode_worker_config().engine.decode_attention == "sdpa"
    assert cfg.prefill_worker_config().engine.decode_attention == "sdpa"
    with pytest.raises(ConfigError, match="decode_attention='sdpa' is the cpu backend's choice"):
        ClusterConfig.from_args({"engine": {"decode_attention": "sdpa", "backend": "torch"}}, NO_ENV)
