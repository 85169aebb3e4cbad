"""Weight-only int8: quantization error bounds, the kernel's two paths, and a tiny model's agreement."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine.config import EngineConfig
from engine.kernels.native_linear import NativeLinear
from engine.kernels.quant import Int8Linear, dequantize_int8, make_linear, quantize_int8
from engine.kv_cache import KVCache
from engine.loading.weights import load_weights
from engine.model.config import ModelConfig
from engine.model.model import LlamaModel, build_model
from engine.runner import DecodeSeq, ModelRunner, PrefillChunk
from tests.support.models import make_tiny


def test_quantize_error_bound_and_range() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 200, generator=g) * torch.logspace(-3, 1, 64)[:, None]  # rows of very different scale
    w[3] = 0.0
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and q.shape == w.shape and scale.shape == (64,)
    assert int(q.abs().max()) <= 127
    assert scale[3] == 1.0 and not q[3].any()  # an all-zero row stays exactly zero
    err = (dequantize_int8(q, scale) - w).abs()
    assert bool((err <= scale[:, None] / 2 * (1 + 1e-5) + 1e-12).all())
    # every nonzero row uses the full range: its largest element maps to ±127
    nz = w.abs().amax(1) > 0
    assert bool((q.abs().amax(1)[nz] == 127).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 16, 17, 64])  # both sides of Int8Linear.int8_mm_max_rows
# 24: a width the int8 kernel is not given (torch's AVX-512 version crashes on it from 2 rows up)
@pytest.mark.parametrize("width", [64, 24])
def test_int8_linear_computes_with_the_dequantized_weight(dtype: torch.dtype, rows: int, width: int) -> None:
    g = torch.Generator().manual_seed(rows)
    w, bias = torch.randn(96, width, generator=g).to(dtype), torch.randn(96, generator=g).to(dtype)
    lin = make_linear(w, bias, quantization="int8")
    assert isinstance(lin, Int8Linear)
    assert lin.nbytes < w.numel() * 2 * 0.6  # int8 + scales: about half of bf16
    x, res = torch.randn(rows, width, generator=g).to(dtype), torch.randn(rows, 96, generator=g).to(dtype)
    want = F.linear(x.float(), lin.dequantized().float(), bias.float()) + res.float()
    got = lin(x, residual=res)
    assert got.dtype == dtype and got.shape == (rows, 96)
    torch.testing.assert_close(got.float(), want, atol=0.15, rtol=0.02)  # bf16 activations
    # and the quantized layer stays close to the original one
    exact = F.linear(x.float(), w.float(), bias.float()) + res.float()
    assert (got.float() - exact).abs().max() < 0.05 * exact.abs().max()


def test_unknown_quantization_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown quantization"):
        make_linear(torch.zeros(4, 4), quantization="int4")
    with pytest.raises(ValueError, match="unknown quantization"):
        EngineConfig(quantization="fp8")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny("llama", tmp_path_factory.mktemp("tiny-int8"), seed=1)


def _runner(path: Path, quantization: str | None) -> ModelRunner:
    cfg = ModelConfig.from_dir(path)
    config = EngineConfig(dtype="bfloat16", quantization=quantization)
    model = build_model(cfg, load_weights(path, cfg, torch.bfloat16), 256, config)
    return ModelRunner(model, KVCache.allocate(cfg, 64, 8, torch.bfloat16))


def test_int8_model_greedy_agreement_is_high(tiny: Path) -> None:
    """Teacher-forced top-1 agreement with the unquantized bf16 model over fixed random prompts."""
    base, q8 = _runner(tiny, None), _runner(tiny, "int8")
    lm_head = q8.model.head.kernel  # int8, run by its own kernel or, where the timed choice says so, the C++ one
    assert isinstance(q8.model, LlamaModel)
    assert isinstance(lm_head.base if isinstance(lm_head, NativeLinear) else lm_head, Int8Linear)
    assert q8.model.weight_nbytes() < 0.6 * base.model.weight_nbytes()
    agree = total = 0
    for seed in range(6):
        ids = torch.randint(3, 256, (48,), generator=torch.Generator().manual_seed(seed)).tolist()
        a = base.prefill([PrefillChunk(ids, 0, list(range(6)))], all_logits=True)
        b = q8.prefill([PrefillChunk(ids, 0, list(range(6)))], all_logits=True)
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        total += len(ids)
    assert agree / total >= 0.9, agree / total
    # the int8 decode path (the int8 matmul kernel, few rows) agrees with the dense bf16 one
    la = base.decode([DecodeSeq(5, 48, list(range(7)))])
    lb = q8.decode([DecodeSeq(5, 48, list(range(7)))])
    assert la.argmax(-1).item() == lb.argmax(-1).item()
    assert (la - lb).abs().max() < 0.05
