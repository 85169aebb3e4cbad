"""`loadtests.bench_sampler --quick` on a tiny random model writes a result that fits SAMPLER_SCHEMA."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from loadtests import bench_sampler
from loadtests.schemas import SAMPLER_SCHEMA
from tests.support.models import CHAT_VOCAB_SIZE, make_tiny_chat_model

pytestmark = pytest.mark.timeout(120)


def test_quick_sampler_bench_output_matches_schema(tmp_path: Path) -> None:
    model = make_tiny_chat_model(tmp_path / "tiny", seed=2)  # a real tokenizer.json: the grammar cases
    out = bench_sampler.main(["--quick", "--model", str(model), "--dtype", "float32",
                              "--out", str(tmp_path / "sampler.json")])
    doc = json.loads(out.read_text())
    jsonschema.validate(doc, SAMPLER_SCHEMA)  # numbers are not asserted: a smoke run on a tiny model
    assert set(doc["results"]["cases"]) == set(bench_sampler.cases(CHAT_VOCAB_SIZE)) | {"json_schema_mask",
                                                                                       "json_schema_greedy"}
    assert out.with_suffix(".png").stat().st_size > 0
