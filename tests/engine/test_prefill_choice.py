"""`engine.kernels.prefill_choice`: the C++ prefill kernel only where it times faster than SDPA here."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import prefill_choice
from engine.kernels.prefill_choice import (
    MARGIN,
    PrefillChoice,
    choose_prefill_attention,
    pick,
    remembered_prefill_attention,
)
from tests.support.markers import needs_cxx


@pytest.mark.parametrize(("native_ms", "sdpa_ms", "chosen"), [
    (1.0, 10.0, True),  # the kernel far ahead
    (9.4, 10.0, True),  # ahead by more than the margin
    (9.6, 10.0, False),  # ahead by less: a tie keeps SDPA
    (60.0, 10.0, False),  # far behind (8-lane vector units)
])
def test_pick_takes_the_kernel_only_past_the_margin(native_ms: float, sdpa_ms: float, chosen: bool) -> None:
    assert MARGIN == 0.05
    assert pick({"native": native_ms, "sdpa": sdpa_ms}) is chosen


def test_a_head_dim_the_kernel_lacks_gets_sdpa_untimed() -> None:
    c = choose_prefill_attention(4, 2, 32)
    assert not c.native and not c.ms
    assert "32" in c.reason and "head dims" in c.reason
    assert c.summary().startswith("sdpa (")


def test_a_dtype_other_than_fp32_gets_sdpa_untimed() -> None:
    c = remembered_prefill_attention(9, 3, 64, torch.bfloat16)
    assert not c.native and not c.ms and "fp32 only" in c.reason


@needs_cxx
def test_both_are_timed_and_the_faster_one_is_kept() -> None:
    c = choose_prefill_attention(9, 3, 64, repeats=1)
    assert set(c.ms) == {"native", "sdpa"} and all(v > 0 for v in c.ms.values())
    assert c.native is pick(c.ms)
    assert "native" in c.summary() and "sdpa" in c.summary()


def test_the_timing_runs_once_per_geometry_and_thread_count(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[tuple[int, int, int]] = []

    def fake(heads: int, kv: int, d: int) -> PrefillChoice:
        asked.append((heads, kv, d))
        return PrefillChoice(False, reason="fake")

    monkeypatch.setattr(prefill_choice, "choose_prefill_attention", fake)
    monkeypatch.setattr(prefill_choice, "_REMEMBERED", {})
    for _ in range(3):
        remembered_prefill_attention(9, 3, 64, torch.float32)
    remembered_prefill_attention(8, 2, 64, torch.float32)
    assert asked == [(9, 3, 64), (8, 2, 64)]
