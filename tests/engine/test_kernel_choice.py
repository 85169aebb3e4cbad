"""`engine.kernels.kernel_choice`: pinned formats are obeyed, ``auto`` times both and keeps one, and the
engine's config reaches the model (``linear_kernels`` and ``quantization``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from engine.config import EngineConfig
from engine.engine import Engine
from engine.kernels.kernel_choice import TIMED_ROWS, build_linears, formats, time_formats
from engine.kernels.native_linear import NativeLinear, native_linear_error
from engine.kernels.quant import CpuLinear, Int8Linear, Linear, PackedLinear, UpcastLinear, onednn_packing_available
from tests.support.markers import needs_cxx
from tests.support.models import make_tiny

needs_onednn = pytest.mark.skipif(not onednn_packing_available(torch.float32), reason="no oneDNN weight packing")


def weights(n: int = 3, out: int = 40, inp: int = 24) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(out, inp, generator=g) for _ in range(n)], [None] * n


@needs_onednn
@pytest.mark.parametrize("mode", ["packed", "plain"])
def test_pinned_format_is_obeyed_and_not_timed(mode: str) -> None:
    ws, bs = weights()
    kernels, choice = build_linears("down", ws, bs, mode=mode)
    assert choice is not None and choice.format == mode and choice.ms_per_pass == {}
    assert (choice.out_features, choice.in_features, choice.count) == (40, 24, 3)
    assert all(isinstance(k, PackedLinear) and k.format == mode for k in kernels)


@needs_onednn
def test_auto_times_every_format_and_keeps_the_one_it_reports() -> None:
    ws, bs = weights()
    kernels, choice = build_linears("qkv", ws, bs, mode="auto")
    native = ["native"] if native_linear_error() is None else []
    assert choice is not None and choice.format in [*PackedLinear.FORMATS, *native]
    assert list(choice.ms_per_pass) == [*PackedLinear.FORMATS, *native]  # the default first
    assert all(set(by_rows) == set(TIMED_ROWS) and min(by_rows.values()) > 0 for by_rows in choice.ms_per_pass.values())
    kind = NativeLinear if choice.format == "native" else PackedLinear
    assert all(isinstance(k, kind) for k in kernels)
    x = torch.randn(1, 24)
    for k, w in zip(kernels, ws, strict=True):  # each kernel computes its own weight, in order
        torch.testing.assert_close(k(x), F.linear(x, w), atol=1e-5, rtol=1e-5)
    assert choice.format in choice.summary() and "qkv" in choice.summary()
    assert choice.native_max_rows == (kernels[0].max_rows if isinstance(kernels[0], NativeLinear) else 0)


@needs_onednn
def test_time_formats_measures_each_row_count() -> None:
    ws, bs = weights(n=2)
    builders = {f: b for f, b in formats(ws[0], None).items() if f in PackedLinear.FORMATS}
    built, ms = time_formats(ws, bs, builders, rows=(1, 3, 5), repeats=2)
    assert {f: len(k) for f, k in built.items()} == {"packed": 2, "plain": 2}
    assert all(sorted(by_rows) == [1, 3, 5] for by_rows in ms.values())


def test_reference_path_is_not_timed_and_int8_ignores_the_dense_modes() -> None:
    ws, bs = weights()
    ref, choice = build_linears("o_proj", ws, bs, fast=False)
    assert choice is None and all(type(k) is Linear for k in ref)
    q8, choice = build_linears("o_proj", ws, bs, quantization="int8", mode="packed")
    assert choice is not None and choice.format == "int8" and all(isinstance(k, Int8Linear) for k in q8)
    q8, choice = build_linears("o_proj", ws, bs, quantization="int8")
    assert choice is not None and choice.format in ("int8", "native") and len(q8) == 3


def test_pick_keeps_the_default_on_a_tie_and_takes_a_clear_winner() -> None:
    from engine.kernels.kernel_choice import pick

    assert pick({"packed": {1: 1.0, 8: 2.0}, "native": {1: 0.99, 8: 1.99}}, margin=0.03) == "packed"
    assert pick({"packed": {1: 1.0, 8: 2.0}, "plain": {1: 0.9, 8: 1.9}, "native": {1: 0.5, 8: 2.2}},
                margin=0.03) == "native"  # geometric mean 0.74 vs 0.92
    assert pick({"packed": {1: 1.0}, "native": {1: 1.5}}, margin=0.03) == "packed"


def test_native_competes_with_a_row_limit_priced_from_the_same_timings() -> None:
    from engine.kernels.kernel_choice import pick, with_native_limits

    # as timed on an AMX Xeon (bf16 qkv): the C++ kernel wins at 1 row, oneDNN from 8 rows on
    ms = {"packed": {1: 2.2, 8: 2.3, 32: 2.8}, "plain": {1: 2.6, 8: 2.4, 32: 3.1}, "native": {1: 1.2, 8: 3.6, 32: 11.8}}
    got = with_native_limits(ms)
    assert got["native<=1"] == {1: 1.2, 8: 2.4, 32: 3.1} and got["native<=8"] == {1: 1.2, 8: 3.6, 32: 3.1}
    assert got["native<=1+packed"] == {1: 1.2, 8: 2.3, 32: 2.8}
    assert set(got) == {*ms, "native<=1", "native<=8", "native<=1+packed", "native<=8+packed"}
    assert got["native"] == ms["native"]
    assert pick(got, margin=0.03) == "native<=1+packed"  # geometric mean 0.82 of packed's
    assert with_native_limits({"packed": {1: 1.0}, "plain": {1: 1.0}}) == {"packed": {1: 1.0}, "plain": {1: 1.0}}


@needs_cxx
def test_a_chosen_row_limit_is_what_the_kernels_run(monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.kernels import kernel_choice

    def timed(weights, biases, builders, rows=kernel_choice.TIMED_ROWS, repeats=3):  # type: ignore[no-untyped-def]
        built = {f: [make(w, b) for w, b in zip(weights, biases, strict=True)] for f, make in builders.items()}
        fast, slow = {r: 1.0 for r in rows}, {r: 0.2 if r == 1 else 9.0 for r in rows}
        return built, {f: slow if f == "native" else fast for f in built}

    monkeypatch.setattr(kernel_choice, "time_formats", timed)
    ws, bs = weights()
    kernels, choice = build_linears("qkv", ws, bs)
    assert choice is not None and choice.format == "native" and choice.native_max_rows == 1
    assert "native up to 1 rows" in choice.summary()
    assert all(isinstance(k, NativeLinear) and k.max_rows == 1 for k in kernels)
    x, k0 = torch.randn(2, 24), kernels[0]
    assert isinstance(k0, NativeLinear) and torch.equal(k0(x), k0.base(x))  # 2 rows: the wrapped kernel's own result


@needs_cxx
@needs_onednn
def test_a_row_limit_over_the_packed_kernel_keeps_the_plain_weight_too(monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.kernels import kernel_choice

    def timed(weights, biases, builders, rows=kernel_choice.TIMED_ROWS, repeats=3):  # type: ignore[no-untyped-def]
        built = {f: [make(w, b) for w, b in zip(weights, biases, strict=True)] for f, make in builders.items()}
        ms = {"packed": {r: 1.0 for r in rows}, "plain": {r: 2.0 for r in rows},
              "native": {r: 0.2 if r == 1 else 9.0 for r in rows}}
        return built, ms

    monkeypatch.setattr(kernel_choice, "time_formats", timed)
    ws, bs = weights()
    kernels, choice = build_linears("qkv", ws, bs)
    assert choice is not None and (choice.format, choice.native_max_rows, choice.wraps) == ("native", 1, "packed")
    for k, w in zip(kernels, ws, strict=True):
        assert isinstance(k, NativeLinear) and isinstance(k.base, PackedLinear) and k.base.format == "packed"
        assert k.nbytes == k.base.nbytes and k.extra_nbytes == w.numel() * 4  # a call reads one of two layouts
        x = torch.randn(3, 24)
        torch.testing.assert_close(k(x[:1]), F.linear(x[:1], w), atol=1e-5, rtol=1e-5)  # natively
        assert torch.equal(k(x), k.base(x))  # 3 rows: the packed kernel
    rows = kernel_choice.TIMED_ROWS
    ms_close = {"packed": {r: 2.0 if r == 1 else 1.0 for r in rows},
                "plain": {r: 2.0 if r == 1 else 1.02 for r in rows},
                "native": {r: 0.5 if r == 1 else 9.0 for r in rows}}
    monkeypatch.setattr(kernel_choice, "time_formats", lambda w, b, builders, *a, **k: (
        {f: [make(x, y) for x, y in zip(w, b, strict=True)] for f, make in builders.items()}, ms_close))
    _, choice = build_linears("qkv", ws, bs)
    # native up to 1 row then plain wins clearly; over packed it would be 1.5% faster still: not worth a copy
    assert choice is not None and (choice.format, choice.native_max_rows, choice.wraps) == ("native", 1, "plain")
    with pytest.raises(ValueError, match="beside a packed"):
        NativeLinear(PackedLinear(ws[0], None, fmt="plain"), plain=ws[0])


@needs_cxx
@needs_onednn
def test_a_somewhat_slower_native_kernel_still_takes_the_rows_a_native_step_runs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """oneDNN's packed kernel wins the class outright; the C++ kernel, 20% slower at one row, still takes
    one-row batches (over the packed kernel, with the plain weight kept) so a one-row step can run as one
    native call; not where that copy would be larger than `STEP_COPY_MAX_BYTES`, nor past the tolerance."""
    from engine.kernels import kernel_choice

    rows = kernel_choice.TIMED_ROWS
    ms = {"packed": {r: 1.0 for r in rows}, "plain": {r: 2.0 for r in rows},
          "native": {r: 1.2 if r == 1 else 9.0 for r in rows}}
    monkeypatch.setattr(kernel_choice, "time_formats", lambda w, b, builders, *a, **k: (
        {f: [make(x, y) for x, y in zip(w, b, strict=True)] for f, make in builders.items()}, ms))
    ws, bs = weights()
    kernels, choice = build_linears("gate_up", ws, bs)
    assert choice is not None and (choice.format, choice.native_max_rows, choice.wraps) == ("native", 1, "packed")
    assert all(isinstance(k, NativeLinear) and k.max_rows == 1 and k.extra_nbytes > 0 for k in kernels)
    monkeypatch.setattr(kernel_choice, "STEP_COPY_MAX_BYTES", 0)
    kernels, choice = build_linears("gate_up", ws, bs)
    assert choice is not None and choice.format == "packed" and not any(isinstance(k, NativeLinear) for k in kernels)
    monkeypatch.setattr(kernel_choice, "STEP_COPY_MAX_BYTES", 1 << 30)
    ms["native"][1] = 1.0 + kernel_choice.STEP_TOLERANCE + 0.1
    _, choice = build_linears("gate_up", ws, bs)
    assert choice is not None and choice.format == "packed"


@needs_cxx
def test_the_fewest_rows_go_native_where_it_beats_the_chosen_kernel_there(monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 without oneDNN packing: "native" wraps upcast, and a row limit over it loses to plain; still
    one row natively then plain beyond is faster at one row and the same elsewhere."""
    from engine.kernels import kernel_choice
    from engine.kernels.kernel_choice import native_prefix

    rows = kernel_choice.TIMED_ROWS
    ms = {"plain": {r: 1.0 for r in rows}, "upcast": {r: 1.5 for r in rows},
          "native": {r: 0.5 if r == 1 else 2.0 for r in rows}}
    assert native_prefix(ms, "plain", 0.03) == 1 and native_prefix(ms, "upcast", 0.03) == 1
    assert native_prefix({**ms, "native": {r: 1.6 for r in rows}}, "plain", 0.5) == 0  # past the tolerance
    assert native_prefix({**ms, "native": {r: 1.4 for r in rows}}, "plain", 0.5) == rows[-1]  # within it
    monkeypatch.setattr(kernel_choice, "onednn_applies", lambda *a: False)
    monkeypatch.setattr(kernel_choice, "time_formats", lambda w, b, builders, *a, **k: (
        {f: [make(x, y) for x, y in zip(w, b, strict=True)] for f, make in builders.items()}, ms))
    ws = [w.bfloat16() for w in weights()[0]]
    kernels, choice = build_linears("qkv", ws, [None] * len(ws))
    assert choice is not None and (choice.format, choice.native_max_rows, choice.wraps) == ("native", 1, "plain")
    x = torch.randn(2, 24).bfloat16()
    for k, w in zip(kernels, ws, strict=True):
        assert isinstance(k, NativeLinear) and type(k.base) is CpuLinear and k.extra_nbytes == 0
        assert torch.equal(k(x), F.linear(x, w))  # 2 rows: plain F.linear, as before


def test_bf16_without_onednn_packing_gets_the_upcast_format(monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.kernels import kernel_choice

    monkeypatch.setattr(kernel_choice, "onednn_applies", lambda *a: False)
    ws = [w.bfloat16() for w in weights()[0]]
    got = formats(ws[0], None)
    assert list(got)[:2] == ["plain", "upcast"]
    k = got["upcast"](ws[0], None)
    assert isinstance(k, UpcastLinear)
    x = torch.randn(UpcastLinear.upcast_min_rows + 3, 24).bfloat16()
    want = F.linear(x.float(), ws[0].float()).bfloat16()
    assert torch.equal(k(x), want)  # many rows: fp32 math, one rounding
    assert torch.equal(k(x[:1]), F.linear(x[:1], ws[0]))  # few rows: bf16 F.linear


def test_unknown_mode_is_refused() -> None:
    ws, bs = weights()
    with pytest.raises(ValueError, match="linear_kernels"):
        build_linears("qkv", ws, bs, mode="fastest")
    with pytest.raises(ValueError, match="linear_kernels"):
        EngineConfig(linear_kernels="fastest")


@needs_onednn
def test_engine_config_reaches_the_model(tmp_path: Path) -> None:
    path = make_tiny("llama", tmp_path / "m", seed=3)
    eng = Engine.from_dir(path, EngineConfig(num_blocks=16, linear_kernels="plain"))
    choices = eng.runner.model.attention.kernel_choices  # type: ignore[attr-defined]
    assert [c.name for c in choices] == ["qkv", "o_proj", "gate_up", "down", "lm_head"]
    assert {c.format for c in choices} == {"plain"}
    q8 = Engine.from_dir(path, EngineConfig(num_blocks=16, dtype="bfloat16", quantization="int8"))
    lm_head = q8.runner.model.head.kernel  # int8, run by its own kernel or, where the timed choice says so, the C++ one
    assert q8.runner.model.attention.config.quantization == "int8"
    assert isinstance(lm_head.base if isinstance(lm_head, NativeLinear) else lm_head, Int8Linear)
