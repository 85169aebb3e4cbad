"""Engines on one CPU machine build (time kernels, compile) one at a time, through a lock file."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

import engine.engine as engine_mod
from engine.config import EngineConfig
from engine.engine import Engine
from tests.support.models import make_tiny

pytestmark = pytest.mark.timeout(120)


def test_a_build_waits_for_the_lock_and_runs_once_it_is_free(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    path = make_tiny("llama", tmp_path / "tiny", seed=1)
    monkeypatch.setattr(engine_mod, "TIMING_LOCK", tmp_path / "timing.lock")
    built = threading.Event()
    real_build = engine_mod.build_model

    def build(*args, **kwargs):  # type: ignore[no-untyped-def]
        built.set()
        return real_build(*args, **kwargs)

    monkeypatch.setattr(engine_mod, "build_model", build)
    cfg = EngineConfig(num_blocks=16, block_size=16)
    result: list[Engine] = []
    with engine_mod.file_lock(tmp_path / "timing.lock"):  # another engine on this machine is building
        t = threading.Thread(target=lambda: result.append(Engine.from_dir(path, cfg)), daemon=True)
        t.start()
        assert not built.wait(1.0), "built while another engine held the timing lock"
    t.join(timeout=100)
    assert built.is_set() and len(result) == 1 and result[0].runner is not None


def test_no_lock_off_the_cpu_fast_path() -> None:
    assert isinstance(engine_mod.timing_lock(EngineConfig(backend="reference")), type(engine_mod.nullcontext()))
    assert not isinstance(engine_mod.timing_lock(EngineConfig()), type(engine_mod.nullcontext()))
