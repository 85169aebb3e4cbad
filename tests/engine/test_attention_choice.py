"""`engine.kernels.attention_choice`: the decode attention method, timed at load or pinned.

That every method computes the reference attention is `test_fast_paths`'s job; here: what gets
timed (and that a process times each shape once), what wins, what happens when the compiled method
cannot run, what is refused, that `EngineConfig.decode_attention` reaches the model, and that a
compiled engine never compiles again once loaded, whatever the step's batch size or context length.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.engine import Engine
from engine.kernels import attention_choice, compiled_attention
from engine.kernels.attention_choice import AttentionChoice, choose_decode_attention, compiled_error, time_methods
from engine.kernels.gathered_decode import DECODE_METHODS, GATHERED_METHODS, SOFTCAP_METHODS
from engine.runner import DecodeSeq
from tests.support.markers import needs_cxx
from tests.support.models import make_tiny


def test_pinned_eager_method_is_not_timed() -> None:
    for m in GATHERED_METHODS:
        assert choose_decode_attention(6, 2, 16, m) == AttentionChoice(m)


def test_off_cpu_devices_get_sdpa_untimed() -> None:
    assert choose_decode_attention(6, 2, 16, "auto", "meta") == AttentionChoice("sdpa")


def test_auto_times_every_method_at_every_size_and_picks_the_fastest(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(attention_choice, "SIZES", ((2, 40), (4, 96)))
    ms = time_methods(6, 2, 16, repeats=1)
    assert set(ms) == set(GATHERED_METHODS)
    assert all(list(by) == ["2x48", "4x96"] and all(t > 0 for t in by.values()) for by in ms.values())
    fake = {m: {"2x48": 1.0 + i, "4x96": 1.0 + i} for i, m in enumerate(reversed(DECODE_METHODS))}
    monkeypatch.setattr(attention_choice, "compiled_error", lambda *a: None)
    monkeypatch.setattr(attention_choice, "time_methods", lambda *a, **k: fake)
    got = choose_decode_attention(6, 2, 16)
    assert got.method == DECODE_METHODS[-1] and got.ms == fake
    assert got.summary().startswith(f"{DECODE_METHODS[-1]} (ms at 2x48/4x96:")


def test_an_engine_times_each_shape_once_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """Engines of one head geometry, dtype and thread count share one timing; any of those changed, or a
    mode pinned, and the choice is its own."""
    timed: list[tuple[int, int, int]] = []

    def fake(heads: int, kv_heads: int, head_dim: int, *a: object, **k: object) -> dict[str, dict[str, float]]:
        timed.append((heads, kv_heads, head_dim))
        return {m: {"2x48": 1.0 + i, "4x96": 1.0 + i} for i, m in enumerate(GATHERED_METHODS)}

    monkeypatch.setattr(attention_choice, "_REMEMBERED", {})
    monkeypatch.setattr(attention_choice, "compiled_error", lambda *a: "not here")
    monkeypatch.setattr(attention_choice, "native_error", lambda: "not here")
    monkeypatch.setattr(attention_choice, "time_methods", fake)
    remembered = attention_choice.remembered_decode_attention
    first = remembered(6, 2, 16)
    assert first.method == GATHERED_METHODS[0] and remembered(6, 2, 16) is first and timed == [(6, 2, 16)]
    remembered(6, 2, 32)
    remembered(6, 2, 16, dtype=torch.bfloat16)
    remembered(6, 2, 16, softcap=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        remembered(6, 2, 16)
    finally:
        torch.set_num_threads(threads)
    assert len(timed) == 5
    assert remembered(6, 2, 16, "per_head") == AttentionChoice("per_head")
    assert remembered(6, 2, 16, "auto", "meta") == AttentionChoice("sdpa")
    assert len(timed) == 5


def test_short_and_long_steps_can_get_different_methods(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = {"sdpa": {"2x48": 1.0, "4x96": 9.0}, "per_head": {"2x48": 2.0, "4x96": 3.0},
            "block_diagonal": {"2x48": 3.0, "4x96": 4.0}, "compiled": {"2x48": 5.0, "4x96": 1.0}}
    monkeypatch.setattr(attention_choice, "compiled_error", lambda *a: None)
    monkeypatch.setattr(attention_choice, "time_methods", lambda *a, **k: fake)
    got = choose_decode_attention(6, 2, 16)
    assert (got.method, got.small_method, got.split_rows) == ("compiled", "sdpa", 192)  # sqrt(96 * 384)
    assert [got.method_for(r) for r in (1, 192, 193, 10_000)] == ["sdpa", "sdpa", "compiled", "compiled"]
    assert got.summary().startswith("sdpa up to 192 rows, then compiled")
    assert AttentionChoice("per_head").method_for(1) == "per_head"


def test_timed_steps_stream_their_caches_from_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(attention_choice, "STREAM_BYTES", 10 * 2**20)
    step = attention_choice._Step.make(8, 272, 6, 2, 16, torch.float32, torch.Generator().manual_seed(0))
    per_layer = 2 * step.k_caches[0].numel() * 4
    assert len(step.k_caches) == min(attention_choice.MAX_LAYERS, -(-10 * 2**20 // per_layer))
    assert len({c.data_ptr() for c in step.k_caches}) == len(step.k_caches)  # distinct memory per layer
    assert all(torch.equal(c, step.k_caches[0]) for c in step.k_caches)


def test_buffers_are_capped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(attention_choice, "SIZES", ((64, 128),))
    monkeypatch.setattr(attention_choice, "MAX_BUFFER_BYTES", 8 * 128 * 2 * 16 * 4)
    assert list(time_methods(6, 2, 16, repeats=1)["sdpa"]) == ["8x128"]


def test_compiled_that_cannot_run_is_left_out_with_a_warning_and_refused_when_pinned(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(*args: object) -> torch.Tensor:
        raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found\nmore detail")

    monkeypatch.setattr(compiled_attention, "_compiled", broken)
    monkeypatch.setattr(attention_choice, "native_error", lambda: "no C++ compiler 'c++' on PATH")
    assert compiled_error(6, 2, 16, torch.float32) == "RuntimeError: InvalidCxxCompiler: No working C++ compiler found"
    monkeypatch.setattr(attention_choice, "SIZES", ((2, 40),))
    with caplog.at_level(logging.WARNING, logger="engine.kernels.attention_choice"):
        got = choose_decode_attention(6, 2, 16)
    assert got.method in GATHERED_METHODS and set(got.ms) == set(GATHERED_METHODS)
    assert "compiled decode attention unavailable" in caplog.text and "No working C++ compiler" in caplog.text
    assert "native decode attention unavailable" in caplog.text
    with pytest.raises(RuntimeError, match=r"cannot run here.*No working C\+\+ compiler"):
        choose_decode_attention(6, 2, 16, "compiled")


@needs_cxx
def test_compiled_is_timed_when_it_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(attention_choice, "SIZES", ((2, 40), (3, 64)))
    assert compiled_error(6, 2, 16, torch.float32) is None
    got = choose_decode_attention(6, 2, 16)
    assert set(got.ms) == set(DECODE_METHODS) and got.method in DECODE_METHODS


def test_unknown_method_is_refused() -> None:
    with pytest.raises(ValueError, match="decode_attention"):
        choose_decode_attention(6, 2, 16, "flash")
    with pytest.raises(ValueError, match="decode_attention"):
        EngineConfig(decode_attention="flash")


def test_engine_config_reaches_the_model(tmp_path: Path) -> None:
    path = make_tiny("llama", tmp_path / "m", seed=3)
    eng = Engine.from_dir(path, EngineConfig(num_blocks=16, decode_attention="block_diagonal"))
    assert eng.runner.model.attention.choice == AttentionChoice("block_diagonal")  # type: ignore[attr-defined]
    ref = Engine.from_dir(path, EngineConfig(num_blocks=16, backend="reference"))
    assert not hasattr(ref.runner.model.attention, "choice")


@needs_cxx
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_compiled_engine_does_not_compile_while_serving(tmp_path: Path, dtype: str) -> None:
    from torch._dynamo.utils import counters

    path = make_tiny("llama", tmp_path / "m", seed=4, num_attention_heads=6, num_key_value_heads=2, hidden_size=96)
    eng = Engine.from_dir(path, EngineConfig(num_blocks=64, block_size=8, dtype=dtype, decode_attention="compiled"))
    graphs = counters["stats"]["unique_graphs"]
    for batch, ctx in ((1, 3), (1, 40), (2, 5), (5, 70), (3, 8)):  # one row / one block / many of both
        seqs = [DecodeSeq(10 + i, ctx, eng.pool.allocate(eng.blocks_for(ctx + 1))) for i in range(batch)]
        logits = eng.runner.decode(seqs)
        assert torch.isfinite(logits).all()
        assert not logits.is_inference()  # callers may change it in place outside inference mode
        for s in seqs:
            eng.pool.free(list(s.block_table))
    assert counters["stats"]["unique_graphs"] == graphs


def test_a_soft_capping_model_gets_only_methods_that_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    timed: list[tuple[str, ...]] = []

    def fake(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
             methods: tuple[str, ...]) -> dict[str, dict[str, float]]:
        timed.append(methods)
        return {m: {"2x48": 1.0, "4x96": 1.0} for m in methods}

    monkeypatch.setattr(attention_choice, "time_methods", fake)
    assert choose_decode_attention(6, 2, 16, softcap=True).method in SOFTCAP_METHODS
    assert timed == [SOFTCAP_METHODS]
    assert choose_decode_attention(6, 2, 16, "auto", "meta", softcap=True) == AttentionChoice(SOFTCAP_METHODS[0])
    for pinned in ("sdpa", "compiled", "native"):
        with pytest.raises(ValueError, match="cannot soft-cap"):
            choose_decode_attention(6, 2, 16, pinned, softcap=True)
