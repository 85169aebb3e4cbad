"""Loading a checkpoint holds about the model once, not twice: the peak resident memory a fresh
process gains while `load_weights` reads a safetensors folder (and every loaded weight is then read
once, as the first forwards read them), and while `convert_gguf_to_hf` converts a GGUF file,
measured by the kernel (the high-water mark ``VmHWM``, reset through ``/proc/self/clear_refs`` just
before), against the size of the weights.

The bound is 1.5x: fused copies made beside tensors that stay mapped from the file (the file's
pages resident as well once read), or the converted model built in memory before it is written,
reach 1.6-2x and more. Memory is behaviour here, not timing: a busy host changes how fast, not how much.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as QT
from safetensors.torch import save_file

from tests.support.gguf_files import write_gguf

pytestmark = pytest.mark.timeout(300)
CLEAR_REFS = Path("/proc/self/clear_refs")
BOUND = 1.5

# Run in a fresh process: imports first, then the high-water mark reset, then the load alone.
_MEASURE = """
import json, sys, torch
from pathlib import Path
from engine.config import ModelConfig
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
