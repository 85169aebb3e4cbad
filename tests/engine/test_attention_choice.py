"""`engine.attention_choice`: the batched fp32 decode attention method, timed at load or pinned.

That every method computes the reference attention is `test_fast_paths`'s job; here: what gets
timed, what wins, what is refused, and that `EngineConfig.decode_attention` reaches the model.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import attention_choice
from engine.attention import DECODE_METHODS
from engine.attention_choice import AttentionChoice, choose_decode_attention, time_methods
from engine.config import EngineConfig
from engine.engine import Engine
from tests.tiny_models import make_tiny


def test_pinned_method_is_not_timed() -> None:
    for m in DECODE_METHODS:
        assert choose_decode_attention(6, 2, 16, m) == AttentionChoice(m)


def test_off_cpu_devices_get_sdpa_untimed() -> None:
    assert choose_decode_attention(6, 2, 16, "auto", "meta") == AttentionChoice("sdpa")


def test_auto_times_every_method_at_every_size_and_picks_the_fastest(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(attention_choice, "SIZES", ((2, 40), (4, 96)))
    ms = time_methods(6, 2, 16, repeats=1)
    assert set(ms) == set(DECODE_METHODS)
    assert all(list(by) == ["2x40", "4x96"] and all(t > 0 for t in by.values()) for by in ms.values())
    fake = {m: {"2x40": 1.0 + i, "4x96": 1.0 + i} for i, m in enumerate(reversed(DECODE_METHODS))}
    monkeypatch.setattr(attention_choice, "time_methods", lambda *a, **k: fake)
    got = choose_decode_attention(6, 2, 16)
    assert got.method == DECODE_METHODS[-1] and got.ms == fake
    assert got.summary().startswith(f"{DECODE_METHODS[-1]} (ms at 2x40/4x96:")


def test_buffers_are_capped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(attention_choice, "SIZES", ((64, 128),))
    monkeypatch.setattr(attention_choice, "MAX_BUFFER_BYTES", 8 * 128 * 2 * 16 * 4)
    assert list(time_methods(6, 2, 16, repeats=1)["sdpa"]) == ["8x128"]


def test_unknown_method_is_refused() -> None:
    with pytest.raises(ValueError, match="decode_attention"):
        choose_decode_attention(6, 2, 16, "flash")
    with pytest.raises(ValueError, match="decode_attention"):
        EngineConfig(decode_attention="flash")


def test_engine_config_reaches_the_model(tmp_path: Path) -> None:
    path = make_tiny("llama", tmp_path / "m", seed=3)
    eng = Engine.from_dir(path, EngineConfig(num_blocks=16, decode_attention="block_diagonal"))
    assert eng.runner.model.attention_choice == AttentionChoice("block_diagonal")
    ref = Engine.from_dir(path, EngineConfig(num_blocks=16, fast_kernels=False))
    assert ref.runner.model.attention_choice is None
