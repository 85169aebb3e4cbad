"""The KV cache sized from a memory budget (`engine.kv_budget`), with a fake device memory report.

The arithmetic first (a fraction of the device's total, bytes, a ``num_blocks`` checked against the
budget, the reserve for transfers in flight, the error text naming the numbers), then an engine
loaded on the CPU with a fake probe that reports a GPU's figures: the same sizing code a GPU runs,
its profile step run against a scratch cache, and the cache and pool it allocates of that size.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.engine import Engine
from engine.errors import MemoryBudgetError
from engine.kv_budget import DEFAULT_CPU_BLOCKS, MemoryUse, check_budget, plan_num_blocks
from engine.memory import GIB, HostProbe, MemoryReport, probe_for
from engine.model.config import ModelConfig

MIB = 1 << 20
BLOCK = 2 * MIB  # a Llama-3-8B block of 16 tokens in bf16


def use(total_gib: float = 80, free_gib: float = 60, weights_gib: float = 15, peak_gib: float = 2) -> MemoryUse:
    return MemoryUse(MemoryReport(total=int(total_gib * GIB), free=int(free_gib * GIB)),
                     weights=int(weights_gib * GIB), peak_step=int(peak_gib * GIB))


def test_a_fraction_is_of_the_devices_total_less_weights_peak_and_reserve() -> None:
    # 0.9 × 80 − 15 − 2 = 55 GiB of 2 MiB blocks; 60 GiB free does not bind
    assert plan_num_blocks(0.9, None, use(), BLOCK) == 55 * 512
    assert plan_num_blocks(0.9, None, use(), BLOCK, reserved=GIB) == 54 * 512
    assert plan_num_blocks(0.5, None, use(), BLOCK) == 23 * 512  # 40 − 15 − 2


def test_a_fraction_is_capped_by_what_is_free_now() -> None:
    # another process holds most of the device: 20 GiB free, less the 2 GiB peak step
    assert plan_num_blocks(0.9, None, use(free_gib=20), BLOCK) == 18 * 512


def test_bytes_are_the_caches_own_size() -> None:
    assert plan_num_blocks(4 * GIB, None, use(), BLOCK) == 2048
    with pytest.raises(MemoryBudgetError) as e:
        plan_num_blocks(40 * GIB, None, use(free_gib=20), BLOCK)
    assert "kv_cache_memory=42949672960 (40.0 GiB) does not fit" in str(e.value)
    assert "20.0 GiB free now" in str(e.value) and "18.0 GiB" in str(e.value)


def test_num_blocks_with_a_budget_is_checked_never_cut() -> None:
    assert plan_num_blocks(0.9, 4096, use(), BLOCK) == 4096
    # a 24 GB card: 0.9 × 24 − 15 − 2.1 = 4.5 GiB, and 16,384 blocks need 32 GiB
    with pytest.raises(MemoryBudgetError) as e:
        plan_num_blocks(0.9, 16384, use(total_gib=24, free_gib=20, peak_gib=2.1), BLOCK)
    msg = str(e.value)
    assert msg.startswith("kv_cache_memory=0.9 leaves 4.5 GiB for the KV cache")
    for part in ("0.9 of 24.0 GiB", "15.0 GiB of weights", "2.1 GiB for the peak step", "num_blocks=16384",
                 "need 32.0 GiB"):
        assert part in msg, part


def test_a_derived_cache_holds_one_sequence_of_max_model_len() -> None:
    tiny = use(total_gib=20, free_gib=20, weights_gib=17.9, peak_gib=0)  # 0.1 GiB left: 51 blocks, 816 tokens
    assert plan_num_blocks(0.9, None, tiny, BLOCK, min_tokens=816, block_size=16) == 51
    with pytest.raises(MemoryBudgetError, match=r"51 blocks, but one sequence of 8192 tokens \(max_model_len\) "
                                                r"needs 512 blocks"):
        plan_num_blocks(0.9, None, tiny, BLOCK, min_tokens=8192, block_size=16)
    with pytest.raises(MemoryBudgetError, match=r"leaves 0\.0 GiB"):  # weights alone exceed the share
        plan_num_blocks(0.5, None, use(total_gib=24), BLOCK)


@pytest.mark.parametrize(("value", "needle"), [
    (0.0, "must be in (0, 1]"), (1.5, "must be in (0, 1]"), (1, "write a float"), (True, "must be bytes"),
    ("16GiB", "must be bytes"),
])
def test_a_budget_that_is_neither_bytes_nor_a_fraction_is_refused(value: object, needle: str) -> None:
    with pytest.raises(ValueError) as e:
        check_budget(value)  # type: ignore[arg-type]
    assert needle in str(e.value) and repr(value) in str(e.value)
    with pytest.raises(ValueError, match="kv_cache_memory"):
        EngineConfig(kv_cache_memory=value)  # type: ignore[arg-type]


def test_the_default_budget_is_cudas_fraction_and_none_on_a_cpu() -> None:
    assert EngineConfig(device="cuda").kv_budget == 0.9
    assert EngineConfig().kv_budget is None and EngineConfig().num_blocks is None
    assert EngineConfig(kv_cache_memory=8 * GIB).kv_budget == 8 * GIB
    assert isinstance(probe_for(EngineConfig().torch_device), HostProbe)
    with pytest.raises(ValueError, match="num_blocks=0"):
        EngineConfig(num_blocks=0)


class FakeProbe:
    """A GPU's report, on the CPU: ``weights`` allocated, ``peak`` for the profiled step."""

    profiles_peak = True

    def __init__(self, report: MemoryReport, weights: int, peak: int) -> None:
        self._report, self._weights, self._peak = report, weights, peak
        self.profiled = 0

    def report(self) -> MemoryReport:
        return self._report

    def allocated(self) -> int:
        return self._weights

    def peak_during(self, fn: Callable[[], object]) -> int:
        fn()  # the real step, against the scratch cache
        self.profiled += 1
        return self._peak


class NoProbe(FakeProbe):
    def __init__(self) -> None:
        super().__init__(MemoryReport(0, 0), 0, 0)

    def report(self) -> MemoryReport:
        raise AssertionError("a CPU engine without a budget asked the device")


def _block_nbytes(path: Path, cfg: EngineConfig) -> int:
    return ModelConfig.from_dir(path).kv_bytes_per_token(cfg.torch_dtype) * cfg.block_size


def test_an_engine_sizes_its_cache_from_a_fake_report(tiny_path: Path) -> None:
    cfg = EngineConfig(kv_cache_memory=0.5, max_step_tokens=64, backend="reference")
    block = _block_nbytes(tiny_path, cfg)
    probe = FakeProbe(MemoryReport(total=1000 * block, free=900 * block), weights=100 * block, peak=50 * block)
    engine = Engine.from_dir(tiny_path, cfg, probe=probe)
    assert probe.profiled == 1  # the peak step ran, against a scratch cache
    assert engine.pool.num_blocks == engine.cache.num_blocks == engine.config.num_blocks == 500 - 100 - 50


def test_an_engine_refuses_num_blocks_its_budget_cannot_hold(tiny_path: Path) -> None:
    cfg = EngineConfig(kv_cache_memory=0.5, num_blocks=400, max_step_tokens=64, backend="reference")
    block = _block_nbytes(tiny_path, cfg)
    probe = FakeProbe(MemoryReport(total=1000 * block, free=900 * block), weights=100 * block, peak=50 * block)
    with pytest.raises(MemoryBudgetError, match=r"kv_cache_memory=0.5 leaves .* num_blocks=400 need"):
        Engine.from_dir(tiny_path, cfg, probe=probe)


def test_a_cpu_engine_without_a_budget_keeps_its_count(tiny_path: Path) -> None:
    assert Engine.from_dir(tiny_path, EngineConfig(num_blocks=32, backend="reference"), probe=NoProbe()
                           ).pool.num_blocks == 32
    assert Engine.from_dir(tiny_path, EngineConfig(backend="reference"), probe=NoProbe()
                           ).cache.num_blocks == DEFAULT_CPU_BLOCKS
