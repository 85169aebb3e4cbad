"""GGUF Q8_0 straight into the group-wise int8 kernel: the kernel against ``F.linear`` of the file's
dequantized weights, and a tiny model's Q8_0 file, loaded with ``quantization: int8`` from the YAML,
against the same file's weights dequantized (gguf's own dequantizer, through the fp32 reference path).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as QT

from cluster.config import ClusterConfig, Environment
from engine.config import EngineConfig
from engine.engine import Engine
from engine.kernels.group_int8 import GroupInt8Linear, GroupQuantized
from engine.kernels.native_linear import NativeLinear
from engine.runner import DecodeSeq, PrefillChunk
from tests.support.gguf_files import TOKENS, tiny_model, write_gguf
from tests.support.markers import needs_cxx

pytestmark = pytest.mark.timeout(300)


def q8_0(w: torch.Tensor) -> GroupQuantized:
    """``w`` through gguf's Q8_0 quantizer, as its int8 values and fp32 block scales."""
    raw = gguf.quants.quantize(w.numpy(), QT.Q8_0).reshape(-1, 34)
    scale = torch.from_numpy(raw[:, :2].copy().view("float16")).float().reshape(w.shape[0], -1)
    q = torch.from_numpy(raw[:, 2:].copy().view("int8")).reshape(w.shape)
    return GroupQuantized(q, scale, 32)


@pytest.mark.parametrize("rows", [1, 5, 40])
def test_kernel_multiplies_by_the_files_weights(rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    w, bias, gain = torch.randn(96, 64, generator=g), torch.randn(96, generator=g), torch.randn(64, generator=g)
    packed = q8_0(w)
    dense = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(w.numpy(), QT.Q8_0), QT.Q8_0).copy())
    assert torch.equal(packed.dequantize(), dense)  # q * scale is exact in fp32
    x, res = torch.randn(rows, 64, generator=g), torch.randn(rows, 96, generator=g)
    lin = GroupInt8Linear(packed, bias)
    lin.rows_per_tile = 40  # more than one tile of output rows
    torch.testing.assert_close(lin(x, residual=res), F.linear(x, dense, bias) + res, atol=1e-5, rtol=1e-5)
    normed = GroupInt8Linear(packed.with_gain(gain), bias).normed(x, 1e-5)
    want = F.linear(gain * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)), dense, bias)
    torch.testing.assert_close(normed, want, atol=1e-5, rtol=1e-5)
    xb = x.bfloat16()
    got = lin(xb)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), F.linear(xb.float(), dense, bias), atol=0.1, rtol=0.02)
    assert lin.nbytes == 96 * 64 + 96 * 2 * 4 + 96 * 4  # int8 values, an fp32 scale per 32 of them, the bias


@needs_cxx
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("out_features", [80, 83])  # 83: a thread's range ends in 1 or 3 rows
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 64])
def test_native_kernel_computes_what_the_torch_kernel_does(dtype: torch.dtype, rows: int, out_features: int,
                                                           threads: int) -> None:
    """The C++ kernel over the same int8 values and group scales (and gain, bias, residual, RMSNorm and
    GLU prologues), up to its int16 rounding of the activations: |dy| <= sum |w| * max |x| / 65534 in
    fp32 (bf16 adds its own rounding of the output)."""
    g = torch.Generator().manual_seed(rows)
    n = out_features
    w, bias, gain = torch.randn(n, 96, generator=g), torch.randn(n, generator=g), torch.randn(96, generator=g)
    base = GroupInt8Linear(q8_0(w).with_gain(gain), bias.to(dtype))
    native = NativeLinear(base)
    x, res = torch.randn(rows, 96, generator=g).to(dtype), torch.randn(rows, n, generator=g).to(dtype)
    gate_up = torch.randn(rows, 192, generator=g).to(dtype)
    w_abs = base.packed.dequantize().abs().sum(1)  # [out]: sum |w|
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for run, xin in ((lambda k: k(x, residual=res), x), (lambda k: k.normed(x, 1e-5), None),
                         (lambda k: k.glu(gate_up, residual=res), None)):
            got, want = run(native).float(), run(base).float()
            assert got.dtype == torch.float32 and got.shape == want.shape
            if dtype == torch.float32 and xin is not None:
                bound = w_abs * xin.abs().amax(1, keepdim=True) / 65534  # [rows, out]
                assert bool(((got - want).abs() <= bound + 1e-5).all())
            atol, rtol = (2e-2, 1e-3) if dtype == torch.float32 else (0.15, 2e-2)
            torch.testing.assert_close(got, want, atol=atol, rtol=rtol)
    finally:
        torch.set_num_threads(before)


def test_a_scale_shape_that_is_no_grouping_is_refused() -> None:
    with pytest.raises(ValueError, match="scale per 32"):
        GroupQuantized(torch.zeros(4, 48, dtype=torch.int8), torch.ones(4, 2), 32)


@pytest.mark.parametrize("native", [False, pytest.param(True, marks=needs_cxx)])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_q8_0_gguf_loads_into_int8_kernels_from_the_yaml(tmp_path: Path, family: str, native: bool,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Every linear keeps the file's int8 values and scales; logits through prefill, a cached-prefix
    chunk and decode match the dequantized weights run by the fp32 reference forward: within 1e-4 on
    the torch kernel (the file's exact weights), within 1e-3 on the C++ one (which rounds each row of
    activations to int16 for its integer sums)."""
    if not native:
        monkeypatch.setattr("engine.kernels.kernel_choice.native_linear_error", lambda: "turned off by the test")
    write_gguf(tmp_path / "m.gguf", tiny_model(family, tied=False), QT.Q8_0, arch=family)
    cluster = ClusterConfig.from_args({"model": str(tmp_path / "m.gguf"), "mode": "colocated",
                                       "engine": {"dtype": "float32", "quantization": "int8"}}, Environment())
    config = cluster.decode_worker_config().engine
    assert config.quantization == "int8"
    q8 = Engine.load(str(tmp_path / "m.gguf"), config, cache_dir=tmp_path / "cache")
    ref = Engine.load(str(tmp_path / "m.gguf"), EngineConfig(dtype="float32", backend="reference"),
                      cache_dir=tmp_path / "cache")
    model = q8.runner.model
    kernels = [k for lk in model.layers for k in lk.linears()] + [model.head.kernel]
    assert all(isinstance(k, NativeLinear) == native for k in kernels)
    assert all(isinstance(k.base if isinstance(k, NativeLinear) else k, GroupInt8Linear) for k in kernels)
    assert {c.format if c.format != "native" else c.wraps for c in model.attention.kernel_choices} == {"int8_group"}
    assert model.weight_nbytes() < 0.3 * ref.runner.model.weight_nbytes()
    tol = 1e-3 if native else 1e-4
    ids = torch.randint(3, len(TOKENS), (40,), generator=torch.Generator().manual_seed(1)).tolist()
    blocks = list(range(4))
    for engine in (q8, ref):
        engine.runner.prefill([PrefillChunk(ids[:24], 0, blocks)], all_logits=True)
    got = q8.runner.prefill([PrefillChunk(ids[24:], 24, blocks)], all_logits=True)
    want = ref.runner.prefill([PrefillChunk(ids[24:], 24, blocks)], all_logits=True)
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    got, want = (e.runner.decode([DecodeSeq(ids[0], 40, blocks)]) for e in (q8, ref))
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@needs_cxx
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_q8_0_decode_step_runs_as_one_native_call(tmp_path: Path, dtype: torch.dtype) -> None:
    """The one-call native step over the group-quantized weights equals the per-layer native path bit
    for bit (logits and cache writes), as it does for dense and per-row int8 weights."""
    write_gguf(tmp_path / "m.gguf", tiny_model("llama", tied=False), QT.Q8_0)
    engines = [Engine.load(str(tmp_path / "m.gguf"), EngineConfig(dtype=str(dtype).removeprefix("torch."),
                                                                   quantization="int8", decode_attention="native"),
                           cache_dir=tmp_path / "cache") for _ in range(2)]
    one_call, per_layer = (e.runner for e in engines)
    assert one_call.model.attention.native_step is not None, one_call.model.attention.native_step_error
    per_layer.model.attention.native_step = None
    ids = torch.randint(3, len(TOKENS), (21,), generator=torch.Generator().manual_seed(2)).tolist()
    tables = [[5, 9], [3, 7]]
    for r in (one_call, per_layer):
        r.prefill([PrefillChunk(ids, 0, tables[0]), PrefillChunk(ids[:9], 0, tables[1])])
    tok, lens = [7, 8], [21, 9]
    for _ in range(4):
        got, want = (r.decode([DecodeSeq(t, n, tb) for t, n, tb in zip(tok, lens, tables, strict=True)])
                     for r in (one_call, per_layer))
        assert torch.equal(got, want)
        tok, lens = got.argmax(-1).tolist(), [n + 1 for n in lens]
    for a, b in zip([*one_call.cache.k, *one_call.cache.v], [*per_layer.cache.k, *per_layer.cache.v], strict=True):
        assert torch.equal(a, b)
