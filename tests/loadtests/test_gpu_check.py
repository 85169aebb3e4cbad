"""`make gpu-check` (`loadtests.gpu_check`): the no-GPU path, the floors' arithmetic against independent
counts, the report's schema and table, and the CPU smoke mode end to end."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import torch

from loadtests import gpu_check
from loadtests import gpu_check_roofline as rf
from loadtests.gpu_check_models import LLAMA3_8B, SMOKE_SHAPE, shape_config
from loadtests.gpu_check_report import GPU_CHECK_SCHEMA, Check, failed, format_table, guarded, report_doc

ROOT = Path(__file__).resolve().parents[2]

# ---- without a GPU ----


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the no-GPU path does not run")
def test_no_gpu_says_so_writes_nothing_and_exits_0(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    assert gpu_check.main([]) == 0
    out = capsys.readouterr().out
    assert "no CUDA GPU found" in out and "nothing was measured" in out
    assert list(tmp_path.iterdir()) == []  # no results/gpu_check.json, nor its folder


def test_a_module_that_does_not_import_fails_the_preflight_and_nothing_runs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu_check, "PREFLIGHT", ("engine.engine", "no_such_module_for_gpu_check"))
    out = tmp_path / "gpu_check.json"
    assert gpu_check.main(["--device", "cpu", "--out", str(out)]) == 1
    (check,) = json.loads(out.read_text())["results"]["checks"]
    assert (check["section"], check["status"]) == ("preflight", "fail")
    assert "no_such_module_for_gpu_check" in check["reason"]


#: project dependencies the device image lacks (torch, transformers and cupy are there, and what
#: transformers brings: numpy, safetensors, tokenizers, huggingface_hub, pyyaml, tqdm)
ABSENT_ON_THE_DEVICE_IMAGE = ("gguf", "llguidance", "msgpack", "psutil", "jinja2", "pydantic", "ray", "fastapi",
                              "uvicorn", "starlette", "prometheus_client", "jsonschema")
#: in a fresh interpreter with those packages made absent (None in ``sys.modules``: ``import`` raises
#: ModuleNotFoundError and ``importlib.util.find_spec`` says None, as for a package never installed)
_WITHOUT_THEM = f"""
import sys
for name in {ABSENT_ON_THE_DEVICE_IMAGE!r}:
    sys.modules[name] = None
import torch
import loadtests.gpu_check, loadtests.gpu_check_families, loadtests.gpu_check_nccl
import loadtests.gpu_check_sampler, loadtests.gpu_check_timing, tests.support.models
import engine.engine, engine.generate, engine.runner, kv_transfer.nccl, kv_transfer.blocks
from loadtests import gpu_check
check = gpu_check.preflight()
assert check.status == "pass", check.reason
"""


def test_imports_with_only_torch_and_transformers() -> None:
    """The device image has torch, transformers and cupy only: every module the check imports (its
    preflight's list) imports without the project's other dependencies, and ``--help`` works."""
    code = _WITHOUT_THEM + "gpu_check.main(['--help'])\n"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "--device" in out.stdout and "--no-timing" in out.stdout


def test_the_nccl_section_and_the_floors_run_without_them() -> None:
    """Past the imports: the NCCL section's one-GPU path (over tests/support/fake_cupy, as in
    `test_nccl_self_transfer_over_the_fake_cupy_moves_every_byte`) and the floors' arithmetic run
    without msgpack and the rest, so neither needs a package the image lacks at run time."""
    code = _WITHOUT_THEM + """
import kv_transfer.nccl as nccl_mod
from loadtests import gpu_check_roofline as rf
from loadtests.gpu_check_models import LLAMA3_8B, shape_config
from loadtests.gpu_check_nccl import nccl_transfer
from tests.support import fake_cupy
nccl_mod._cupy = fake_cupy.modules
nccl_mod._current_device = lambda: torch.device("cpu")
src = [torch.arange(n * 16, dtype=torch.float32).reshape(n, 16) for n in (1, 3)]
dst = [torch.zeros_like(t) for t in src]
print(nccl_transfer(src, dst))
assert all(torch.equal(a, b) for a, b in zip(src, dst, strict=True))
import tempfile, pathlib
cfg = shape_config(pathlib.Path(tempfile.mkdtemp()), LLAMA3_8B)
print(rf.decode_weight_bytes(cfg, 1) + cfg.vocab_size * cfg.hidden_size)
print(sorted(m for m in sys.modules if m.partition(".")[0] in ("gguf", "llguidance", "msgpack", "psutil")
             and sys.modules[m] is not None))
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    how, params, loaded = out.stdout.strip().splitlines()[-3:]
    assert "sending to itself" in how
    assert int(params) == 8_030_261_248  # Meta-Llama-3-8B's parameters, as the in-process test
    assert loaded == "[]"


# ---- the floors ----


def test_llama3_8b_weight_bytes_match_its_published_parameter_count(tmp_path: Path) -> None:
    cfg = shape_config(tmp_path, LLAMA3_8B)
    embed = cfg.vocab_size * cfg.hidden_size
    assert rf.decode_weight_bytes(cfg, 1) + embed == 8_030_261_248  # Meta-Llama-3-8B's parameters
    assert cfg.kv_bytes_per_token(torch.bfloat16) == 131_072
    step = rf.decode_bytes(cfg, torch.bfloat16, [1025] * 8)
    assert step == 2 * (8_030_261_248 - embed) + 8 * 1025 * 131_072
    assert rf.decode_floor_s(step, 3350.0) == pytest.approx(step / 3.35e12)


def test_weight_bytes_equal_transformers_parameters(tmp_path: Path) -> None:
    import transformers

    cfg = shape_config(tmp_path, SMOKE_SHAPE)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMOKE_SHAPE))
    assert rf.decode_weight_bytes(cfg, 4) + 4 * cfg.vocab_size * cfg.hidden_size == 4 * sum(
        p.numel() for p in hf.parameters())


def test_random_weights_have_the_loaders_shapes(tmp_path: Path) -> None:
    """The in-memory 8B-shaped weights are what `load_weights` makes of a transformers checkpoint."""
    import transformers

    from engine.loading.weights import load_weights
    from loadtests.gpu_check_models import random_weights

    cfg = shape_config(tmp_path / "cfg", SMOKE_SHAPE)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMOKE_SHAPE)).save_pretrained(tmp_path / "hf")
    loaded = load_weights(tmp_path / "hf", cfg, torch.float32, "cpu")
    ours = random_weights(cfg, torch.float32, torch.device("cpu"))

    def shapes(w: object) -> dict[str, object]:
        return {k: None if v is None else tuple(v.shape) for k, v in vars(w).items() if k != "layers"}

    assert shapes(ours) == shapes(loaded)
    assert len(ours.layers) == len(loaded.layers) == cfg.num_layers
    assert all(shapes(a) == shapes(b) for a, b in zip(ours.layers, loaded.layers, strict=True))
    assert all(torch.isfinite(layer.qkv).all() for layer in ours.layers)  # type: ignore[arg-type]


@pytest.mark.parametrize("n", [1, 50])
def test_prefill_flops_against_transformers_flop_count(tmp_path: Path, n: int) -> None:
    """transformers' eager attention multiplies the full square of scores; the floor counts the causal
    triangle: they differ by exactly ``2 * q_size * layers * n * (n - 1)``."""
    import transformers
    from torch.utils.flop_counter import FlopCounterMode

    cfg = shape_config(tmp_path, SMOKE_SHAPE)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMOKE_SHAPE, attn_implementation="eager")).eval()
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        hf(torch.randint(0, cfg.vocab_size, (1, n)), logits_to_keep=1)
    square = 2 * cfg.q_size * cfg.num_layers * n * (n - 1)
    assert counter.get_total_flops() == rf.prefill_flops(cfg, n) + square


def test_nominal_figures_by_device_name() -> None:
    assert rf.nominal_for("NVIDIA H100 80GB HBM3") == rf.Nominal("H100 SXM", 3350.0, 989.0)
    assert rf.nominal_for("NVIDIA H100 PCIe").card == "H100 PCIe"  # type: ignore[union-attr]
    assert rf.nominal_for("NVIDIA H200").card == "H200 SXM"  # type: ignore[union-attr]
    assert rf.nominal_for("NVIDIA A100-SXM4-80GB").hbm_gbs == 2039.0  # type: ignore[union-attr]
    assert rf.nominal_for("NVIDIA GeForce RTX 4090") is None  # unknown cards get no guessed figure


def test_timed_median_runs_warmup_then_repeats() -> None:
    calls: list[int] = []
    t = rf.timed_median_s(lambda: calls.append(1), torch.device("cpu"), repeats=5, warmup=3)
    assert len(calls) == 8 and t >= 0


# ---- the report ----


def _checks() -> list[Check]:
    return [
        Check("families", "llama/fp32-greedy/torch", "pass", {"tokens": 24, "min_gap": 1e-3}),
        Check("graphs", "llama/graphs-on=off", "skip", reason="CUDA graphs need a CUDA device"),
        Check("timing", "decode step b1", "fail", {"step_ms": 1.0, "floor_ms": float("nan")},
              reason="faster than the nominal floor", kind="timing"),
    ]


def test_report_matches_schema_and_passes_without_a_failed_correctness_check() -> None:
    doc = report_doc(_checks(), {"device": "cuda", "gpu": "x", "torch": "2"}, {"description": "d"}, 12.34)
    jsonschema.validate(doc, GPU_CHECK_SCHEMA)
    res = doc["results"]
    assert res["passed"] is True  # the failed check is a timing: it never decides the exit status
    assert res["counts"] == {"pass": 1, "fail": 1, "skip": 1}
    assert [c["passed"] for c in res["checks"]] == [True, None, False]
    assert res["checks"][2]["figures"]["floor_ms"] is None  # NaN is not JSON
    json.dumps(doc, allow_nan=False)


def test_a_failed_correctness_check_fails_the_run() -> None:
    bad = [*_checks(), Check("nccl", "handoff", "fail", reason="bytes differ")]
    assert [c.name for c in failed(bad)] == ["handoff"]
    doc = report_doc(bad, {"device": "cuda", "gpu": "x", "torch": "2"}, {"description": "d"}, 1.0)
    assert doc["results"]["passed"] is False


def test_a_failure_or_skip_must_say_why() -> None:
    with pytest.raises(ValueError, match="must say why"):
        Check("families", "x", "fail")
    with pytest.raises(ValueError, match="unknown status"):
        Check("families", "x", "ok")  # type: ignore[arg-type]


def test_guarded_turns_an_exception_into_a_named_failure() -> None:
    def boom() -> list[Check]:
        raise RuntimeError("no device")

    (c,) = guarded("nccl", "handoff", boom)
    assert (c.status, c.reason) == ("fail", "RuntimeError: no device")


def test_table_lists_every_check_with_reasons_and_counts() -> None:
    table = format_table(_checks(), width=100)
    lines = table.splitlines()
    assert all(len(line) <= 100 for line in lines)
    assert lines[2].startswith("PASS") and "families/llama/fp32-greedy/torch" in lines[2] and "tokens=24" in lines[2]
    assert lines[3].startswith("SKIP") and "CUDA graphs need a CUDA device" in lines[3]
    assert lines[4].startswith("FAIL") and "faster than the nominal floor (step_ms=1" in lines[4]
    assert lines[-1] == "1 passed, 1 failed, 1 skipped"


# ---- the smoke mode: the whole script on CPU ----


@pytest.mark.timeout(600)
def test_cpu_smoke_run_writes_a_valid_report(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    assert gpu_check.main(["--device", "cpu", "--families", "llama", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    jsonschema.validate(doc, GPU_CHECK_SCHEMA)
    checks = {(c["section"], c["name"]): c for c in doc["results"]["checks"]}
    for name in ("llama/fp32-greedy/reference", "llama/fp32-greedy/torch", "llama/fp32-logits/torch",
                 "llama/bf16-logits/torch"):
        assert checks[("families", name)]["status"] == "pass", checks[("families", name)]
    assert checks[("backends", "llama/torch=reference")]["status"] == "pass"
    for key in (("graphs", "llama/graphs-on=off"), ("nccl", "prefill->decode handoff"),
                ("sampler", "device=host rules")):
        assert checks[key]["status"] == "skip" and checks[key]["reason"]
    assert checks[("budget", "kv cache within kv_cache_memory")]["status"] == "pass"
    timings = [c for c in doc["results"]["checks"] if c["section"] == "timing"]
    assert timings and all(c["status"] == "skip" and "CPU smoke" in c["reason"] for c in timings)
    assert all(math.isfinite(c["figures"]["step_ms"]) for c in timings if "step_ms" in c["figures"])


@pytest.mark.gpu
@pytest.mark.timeout(600)
def test_cuda_run_of_one_family_passes(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    assert gpu_check.main(["--families", "llama", "--no-timing", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["machine"]["gpu"] and doc["results"]["passed"] is True
    statuses = {(c["section"], c["name"]): c["status"] for c in doc["results"]["checks"]}
    assert statuses[("graphs", "llama/graphs-on=off")] == "pass"
    assert statuses[("sampler", "device=host rules")] == "pass"


def test_nccl_self_transfer_over_the_fake_cupy_moves_every_byte(monkeypatch: pytest.MonkeyPatch) -> None:
    """The one-GPU path of the NCCL section (a single-rank communicator sending to itself), run over
    tests/support/fake_cupy on CPU tensors; the real cupy runs it in `make gpu-check`."""
    import kv_transfer.nccl as nccl_mod
    from loadtests.gpu_check_nccl import nccl_transfer
    from tests.support import fake_cupy

    monkeypatch.setattr(nccl_mod, "_cupy", fake_cupy.modules)
    monkeypatch.setattr(nccl_mod, "_current_device", lambda: torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    src = [torch.randn(n, 16, 2, 8, generator=g).to(dtype) for n, dtype in ((1, torch.float32), (3, torch.bfloat16))]
    dst = [torch.zeros_like(t) for t in src]
    how = nccl_transfer(src, dst)
    assert "sending to itself" in how
    assert all(torch.equal(s, d) for s, d in zip(src, dst, strict=True))
