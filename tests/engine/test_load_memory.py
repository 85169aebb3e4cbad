"""Loading a checkpoint holds about the model once, not twice: the peak resident memory a fresh
process gains while `load_weights` reads a safetensors folder (and every loaded weight is then read
once, as the first forwards read them), and while `convert_gguf_to_hf` converts a GGUF file,
measured by the kernel (the high-water mark ``VmHWM``, reset through ``/proc/self/clear_refs`` just
before), against the size of the weights.

The bound is 1.5x: fused copies made beside tensors that stay mapped from the file (the file's
pages resident as well once read), or the converted model built in memory before it is written,
reach 1.6-2x and more. Memory is behaviour here, not timing: a busy host changes how fast, not how much.

Building the model never holds a loaded class of linears beside its folded copy longer than that
class's build: weak references to the loaded qkv / gate_up / lm_head tensors are dead when the cpu
backend builds the next class and when the KV cache is allocated (nothing keeps the loaded weights).
"""

from __future__ import annotations

import json
import subprocess
import sys
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as QT
from safetensors.torch import save_file

import engine.engine as engine_module
import engine.kernels.cpu_linears as cpu_linears
from engine.config import EngineConfig
from engine.engine import Engine
from engine.kv_cache import KVCache
from tests.support.gguf_files import write_gguf
from tests.support.models import make_tiny

pytestmark = pytest.mark.timeout(300)
CLEAR_REFS = Path("/proc/self/clear_refs")
BOUND = 1.5

# Run in a fresh process: imports first, then the high-water mark reset, then the load alone.
_MEASURE = """
import json, sys, torch
from pathlib import Path
from engine.model.config import ModelConfig
from engine.loading.gguf_loader import convert_gguf_to_hf
from engine.loading.weights import load_weights

def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024

what, src = sys.argv[1], Path(sys.argv[2])
cfg = ModelConfig.from_dir(src) if what == "safetensors" else None
Path("/proc/self/clear_refs").write_text("5")
base = rss()
if what == "safetensors":
    w = load_weights(src, cfg, torch.float32)
    tensors = [w.embed, w.norm, w.lm_head] + [t for lw in w.layers for t in vars(lw).values() if t is not None]
    print(sum(float(t.float().sum()) for t in tensors), file=sys.stderr)  # every page read, as forwards read them
else:
    convert_gguf_to_hf(src, Path(sys.argv[3]), progress=False)
print(json.dumps({"growth": hwm() - base}))
"""


def _peak_growth(*args: str) -> int:
    out = subprocess.run([sys.executable, "-c", _MEASURE, *args], capture_output=True, text=True, timeout=240,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr[-2000:]
    return int(json.loads(out.stdout.strip().splitlines()[-1])["growth"])


def _model() -> transformers.PreTrainedModel:
    cfg = transformers.LlamaConfig(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                                   num_key_value_heads=8, vocab_size=4096, tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).float().eval()  # ~ 70 MB of fp32 weights


needs_clear_refs = pytest.mark.skipif(not CLEAR_REFS.exists(), reason="needs Linux's /proc/self/clear_refs")


@needs_clear_refs
def test_safetensors_load_peaks_near_the_models_size(tmp_path: Path) -> None:
    model = _model()
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    model.config.save_pretrained(tmp_path)
    size = sum(t.numel() * t.element_size() for t in state.values())
    del model, state
    growth = _peak_growth("safetensors", str(tmp_path))
    assert growth < BOUND * size, f"peak grew {growth / 1e6:.0f} MB loading {size / 1e6:.0f} MB of weights"


@needs_clear_refs
def test_gguf_conversion_peaks_near_the_files_size(tmp_path: Path) -> None:
    model = _model()
    write_gguf(tmp_path / "m.gguf", model, QT.F32)
    size = (tmp_path / "m.gguf").stat().st_size
    del model
    growth = _peak_growth("gguf", str(tmp_path / "m.gguf"), str(tmp_path / "hf"))
    assert growth < BOUND * size, f"peak grew {growth / 1e6:.0f} MB converting a {size / 1e6:.0f} MB file"
    assert (tmp_path / "hf" / "model.safetensors").stat().st_size >= size * 0.95  # the weights are all there


@pytest.mark.parametrize("family", ["llama", "gemma2"])  # gemma2: offset norm gains, copied before the fold
def test_loaded_linears_are_freed_as_their_class_is_built(tmp_path: Path, family: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    path = make_tiny(family, tmp_path / family)
    loaded: dict[str, weakref.ref[Any]] = {}
    alive_at: dict[str, set[str]] = {}

    def alive() -> set[str]:
        return {name for name, ref in loaded.items() if ref() is not None}

    real_load = engine_module.load_weights

    def spy_load(*args: Any, **kwargs: Any) -> Any:
        w = real_load(*args, **kwargs)
        for i, lw in enumerate(w.layers):
            loaded[f"qkv{i}"], loaded[f"gate_up{i}"] = weakref.ref(lw.qkv), weakref.ref(lw.gate_up)
        loaded["lm_head"] = weakref.ref(w.lm_head)
        return w

    def spy_build(real: Any) -> Any:
        def build(name: str, *args: Any, **kwargs: Any) -> Any:
            alive_at[name] = alive()
            return real(name, *args, **kwargs)
        return build

    real_allocate = KVCache.allocate

    def spy_allocate(*args: Any, **kwargs: Any) -> KVCache:
        alive_at["kv_cache"] = alive()
        return real_allocate(*args, **kwargs)

    monkeypatch.setattr(engine_module, "load_weights", spy_load)
    monkeypatch.setattr(cpu_linears, "build_linears", spy_build(cpu_linears.build_linears))
    monkeypatch.setattr(KVCache, "allocate", spy_allocate)
    # the cpu backend folds each norm gain into a copy of qkv / gate_up / lm_head; oneDNN's plain format keeps it
    Engine.from_dir(path, EngineConfig(num_blocks=8, backend="cpu", linear_kernels="plain",
                                       decode_attention="per_head"))
    layers = [f"qkv{i}" for i in range(2)]
    assert not alive_at["o_proj"] & set(layers), "loaded qkv kept while o_proj is built"
    assert not alive_at["down"] & {f"gate_up{i}" for i in range(2)}, "loaded gate_up kept while down is built"
    assert alive_at["kv_cache"] == set(), f"loaded weights {sorted(alive_at['kv_cache'])} kept past the build"
