"""`loadtests.bench_engine --quick` on a tiny random model writes a result that fits ENGINE_SCHEMA."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from loadtests import bench_engine
from loadtests.schemas import ENGINE_SCHEMA
from tests.support.models import make_tiny

pytestmark = pytest.mark.timeout(120)


def test_quick_bench_output_matches_schema(tmp_path: Path) -> None:
    model = make_tiny("llama", tmp_path / "tiny", seed=2)
    out = bench_engine.main(["--quick", "--model", str(model), "--out", str(tmp_path / "engine.json"),
                             "--threads", "1"])
    doc = json.loads(out.read_text())
    jsonschema.validate(doc, ENGINE_SCHEMA)  # numbers are not asserted: a smoke run on a tiny model
    res = doc["results"]
    assert {r["dtype"] for r in res["runs"]} == {"float32", "bfloat16"}
    assert res["int8"]["base_dtype"] == "bfloat16"
    names = {t["name"] for t in res["targets"]}
    assert {"int8_decode_b1_vs_base", "int8_greedy_agreement", "decode_b1_vs_weight_floor_float32"} <= names
    assert all(r["profile"][0]["top_ops"] for r in res["runs"])
    assert out.with_suffix(".png").stat().st_size > 0
