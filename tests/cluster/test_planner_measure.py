"""`cluster.planner.measure` (`pdserve profile`): a tiny model's engine timed into a profile the
planner reads back and fits."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.planner.measure import Sizes, measure, parse_sizes
from cluster.planner.profile import ReplicaProfile, fit
from engine.config import EngineConfig

pytestmark = pytest.mark.timeout(180)


def test_a_measured_profile_has_every_point_and_fits(tiny_path: Path, tmp_path: Path) -> None:
    sizes = Sizes(prefill=(8, 32), batches=(1, 2), contexts=(8, 24), repeats=1)
    p = measure(str(tiny_path), EngineConfig(num_blocks=8), sizes, progress=False, transfer_bytes_per_s=5e8)
    assert p.source == "measured" and p.kv_blocks == 8  # the configured replica's pool, not the timings'
    assert [x.tokens for x in p.prefill] == [8, 32]
    assert [(x.batch, x.context) for x in p.decode] == [(1, 8), (1, 24), (2, 8), (2, 24)]
    assert all(x.seconds > 0 for x in (*p.prefill, *p.decode)) and p.transfer_bytes_per_s == 5e8
    p.save(tmp_path / "p.json")
    assert ReplicaProfile.load(tmp_path / "p.json") == p
    assert fit(p).step.base_s > 0


def test_sizes_are_checked() -> None:
    assert parse_sizes("16, 64,256") == (16, 64, 256)
    with pytest.raises(ValueError, match="'16,x'"):
        parse_sizes("16,x")
    with pytest.raises(ValueError, match=">= 3 decode points"):
        Sizes(batches=(1,), contexts=(8, 16))
