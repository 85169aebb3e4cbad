"""`engine.kernels.native_linear`: the C++ decode-step linear against float64 ``F.linear`` of the weight it wraps.

Every weight format (fp32, bf16, int8 + scales) and activation dtype, each fused prologue (none,
RMSNorm without gain, silu(gate) * up) and epilogue (bias, residual), row counts on both sides of the
kernel's chunk of 4 rows, in balanced chunks of up to 6 beyond 4 rows (33: five of 6 and one of 3),
and of ``max_rows`` (where the wrapped kernel takes over, bit for bit), and
shapes that are not multiples of the vector width or the stream count. Then what it refuses, and the
kernel choice: pinned ``"native"`` is obeyed, refused with the reason where no compiler exists.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine.kernels import kernel_choice, native_linear
from engine.kernels.kernel_choice import build_linears
from engine.kernels.native_linear import NativeLinear, native_applies
from engine.kernels.quant import Int8Linear, Linear, PackedLinear, make_linear, onednn_packing_available
from tests.support.markers import needs_cxx

EPS = 1e-5


def base_kernel(wdtype: str, out: int, inp: int, bias: bool, seed: int = 0) -> Linear:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inp, generator=g) / inp**0.5
    b = torch.randn(out, generator=g) if bias else None
    if wdtype == "int8":
        return make_linear(w.bfloat16(), None if b is None else b.bfloat16(), quantization="int8")
    dt = getattr(torch, wdtype)
    return Linear(w.to(dt), None if b is None else b.to(dt))


def weight64(base: Linear) -> torch.Tensor:
    """The weight ``base`` multiplies by, in float64 (int8: q * scale exactly; dequantized() rounds to bf16)."""
    if isinstance(base, Int8Linear):
        return base.qweight.double() * base.scale.double()[:, None]
    return base.weight.double()


def prologue64(x: torch.Tensor, pre: str) -> torch.Tensor:
    xd = x.double()
    if pre == "rms":
        return xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + EPS)
    if pre == "glu":
        gate, up = xd.chunk(2, dim=-1)
        return F.silu(gate) * up
    return xd


def oracle(base: Linear, x: torch.Tensor, pre: str, residual: torch.Tensor | None) -> torch.Tensor:
    """float64 F.linear of the weight ``base`` multiplies by, after the prologue, plus the epilogue."""
    y = F.linear(prologue64(x, pre), weight64(base), None if base.bias is None else base.bias.double())
    return y if residual is None else y + residual.double()


def int16_rounding_bound(base: Linear, x: torch.Tensor, pre: str) -> torch.Tensor:
    """[T, out]: how far the int8 kernel may move y by rounding pre(x) to int16 per row (small_linear.h:
    step s = max |pre(x)| / 32767, so each value moves by at most s / 2): sum_k |w[n, k]| * s / 2."""
    xd = prologue64(x, pre)
    step = xd.abs().amax(-1, keepdim=True) / 32767  # [T, 1]
    return (step / 2) * weight64(base).abs().sum(-1)[None, :]  # [T, out]


@needs_cxx
@pytest.mark.parametrize("wdtype", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("xdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pre", ["none", "rms", "glu"])
@pytest.mark.parametrize("rows", [1, 2, 5, 9, 20, 33])
def test_native_linear_matches_float64_f_linear(wdtype: str, xdtype: torch.dtype, pre: str, rows: int) -> None:
    # 37: not a multiple of the 4 streams nor of the 2 adjacent rows beyond 4; 20: a vector of 8, a tail of 4
    out, inp = 37, 20
    base = base_kernel(wdtype, out, inp, bias=rows % 2 == 1, seed=rows)
    lin = NativeLinear(base)
    g = torch.Generator().manual_seed(100 + rows)
    x = (torch.randn(rows, inp * (2 if pre == "glu" else 1), generator=g) * 3).to(xdtype)
    residual = torch.randn(rows, out, generator=g).to(xdtype) if pre != "rms" else None
    if pre == "none":
        got = lin(x, residual)
    elif pre == "rms":
        got = lin.normed(x, EPS)
    else:
        got = lin.glu(x, residual)
    assert got.dtype == xdtype and got.shape == (rows, out)
    want = oracle(base, x, pre, residual)
    tol = 1e-5 if xdtype == torch.float32 else 1e-2  # bf16: one rounding of the output
    allowed = tol * want.abs().max().item() + tol * want.abs()  # [T, out]
    if wdtype == "int8":  # exact integer sums over pre(x) rounded to int16 (AVX2), within this bound
        allowed = allowed + int16_rounding_bound(base, x, pre) * (1 + tol)
    err = (got.double() - want).abs()
    assert bool((err <= allowed).all()), (err - allowed).max().item()


@needs_cxx
@pytest.mark.parametrize("rows", [1, 3])
def test_int8_sums_do_not_overflow_at_the_worst_case(rows: int) -> None:
    """Every weight at +127 and every input at the int16 maximum, over K = 8,200 (four flushes of the
    int32 lanes and a tail): a lane that kept adding past 2,048 values would pass 2^31 at ~4,140."""
    k = 8200
    base = make_linear(torch.ones(5, k, dtype=torch.bfloat16), quantization="int8")  # q = 127, scale 1/127
    x = torch.full((rows, k), 3.0)
    got = NativeLinear(base)(x)
    want = oracle(base, x, "none", None)  # 3 * 8200 * (127 * scale) each
    torch.testing.assert_close(got.double(), want, atol=0, rtol=1e-5)


@needs_cxx
@pytest.mark.parametrize("wdtype", ["float32", "int8"])
@pytest.mark.parametrize("limit", [NativeLinear.MAX_ROWS, 3])  # 3: a limit `engine.kernels.kernel_choice` may set
def test_above_max_rows_the_wrapped_kernel_runs_unchanged(wdtype: str, limit: int) -> None:
    base = base_kernel(wdtype, 24, 16, bias=True)
    lin = NativeLinear(base, max_rows=limit)
    rows = limit + 1
    x = torch.randn(rows, 16).to(torch.bfloat16 if wdtype == "int8" else torch.float32)
    r = torch.randn(rows, 24).to(x.dtype)
    assert torch.equal(lin(x, r), base(x, r))
    assert torch.equal(lin.normed(x, EPS), base.normed(x, EPS))
    assert torch.equal(lin.glu(torch.cat([x, x], -1), r), base.glu(torch.cat([x, x], -1), r))
    assert lin.nbytes == base.nbytes


@needs_cxx
def test_bad_inputs_are_refused() -> None:
    lin = NativeLinear(base_kernel("float32", 8, 16, bias=False))
    for limit in (0, NativeLinear.MAX_ROWS + 1):
        with pytest.raises(ValueError, match=r"max_rows must lie in \[1, 64\]"):
            NativeLinear(lin.base, max_rows=limit)
    with pytest.raises(ValueError, match=r"takes a CPU fp32/bf16 \[T, 16\] input"):
        lin(torch.zeros(1, 15))
    with pytest.raises(ValueError, match=r"\[T, 32\] input"):
        lin.glu(torch.zeros(1, 16))
    with pytest.raises(ValueError, match="fp32/bf16"):
        lin(torch.zeros(1, 16, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"residual must be \[2, 8\]"):
        lin(torch.zeros(2, 16), torch.zeros(2, 7))


@pytest.mark.skipif(not onednn_packing_available(torch.float32), reason="no oneDNN weight packing")
def test_a_prepacked_weight_cannot_be_wrapped() -> None:
    packed = PackedLinear(torch.randn(8, 16), fmt="packed")
    assert not native_applies(packed) and native_applies(PackedLinear(torch.randn(8, 16), fmt="plain"))
    with pytest.raises(ValueError, match="plain CPU"):
        NativeLinear(packed)


@needs_cxx
def test_pinned_native_is_obeyed_for_dense_and_int8() -> None:
    ws = [torch.randn(40, 24) for _ in range(3)]
    kernels, choice = build_linears("down", ws, [None] * 3, mode="native")
    assert choice is not None and choice.format == "native" and choice.ms_per_pass == {}
    assert all(isinstance(k, NativeLinear) for k in kernels)
    x = torch.randn(1, 24)
    for k, w in zip(kernels, ws, strict=True):
        torch.testing.assert_close(k(x), F.linear(x, w), atol=1e-5, rtol=1e-5)
    q8, choice = build_linears("down", [w.bfloat16() for w in ws], [None] * 3, quantization="int8", mode="native")
    assert choice is not None and choice.format == "native"
    assert all(isinstance(k, NativeLinear) and isinstance(k.base, Int8Linear) for k in q8)


def test_without_a_compiler_native_is_left_out_and_refused_when_pinned(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("CXX", "no-such-compiler-xyz")
    monkeypatch.setenv("PDSERVE_NATIVE_CACHE", str(tmp_path))
    native_linear.load.cache_clear()
    try:
        ws = [torch.randn(40, 24) for _ in range(2)]
        assert "native" not in kernel_choice.formats(ws[0], None)
        with pytest.raises(RuntimeError, match=r"linear_kernels='native' cannot run here.*no-such-compiler-xyz"):
            build_linears("qkv", ws, [None] * 2, mode="native")
        kernels, choice = build_linears("qkv", ws, [None] * 2, mode="auto")
        assert choice is not None and "native" not in choice.ms_per_pass
        assert not any(isinstance(k, NativeLinear) for k in kernels)
    finally:
        native_linear.load.cache_clear()
