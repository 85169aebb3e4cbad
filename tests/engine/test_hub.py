"""Hub ids through `prepare_model`: a pre-populated huggingface_hub cache in tmp_path, offline.

The cache is laid out as huggingface_hub lays it out (``models--org--name/snapshots/<rev>/...``,
``refs/main``); downloads are faked only where the online path's requests are checked (which files,
which progress bars), since tests cannot reach the hub.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import huggingface_hub
import pytest
import torch

from engine.errors import ModelLoadError
from engine.loading.bundled import prepare_model, stored_dtype
from engine.loading.hub import METADATA_FILES, is_hub_id
from engine.loading.weights import load_weights
from engine.model.config import ModelConfig
from engine.tokenizer import Tokenizer
from tests.support.models import bundled_tokenizer_dir, make_tiny

REPO = "tiny-org/Tiny-Llama"
REV = "0123456789abcdef0123456789abcdef01234567"
ROOT = Path(__file__).resolve().parents[2]


def snapshot(cache: Path, repo: str = REPO) -> Path:
    storage = cache / f"models--{repo.replace('/', '--')}"
    (storage / "refs").mkdir(parents=True, exist_ok=True)
    (storage / "refs" / "main").write_text(REV)  # no newline: huggingface_hub reads it as is
    return storage / "snapshots" / REV


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = make_tiny("llama", tmp_path_factory.mktemp("tiny"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(bundled_tokenizer_dir() / name, folder / name)
    return folder


@pytest.fixture
def cache(tmp_path: Path, tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A hub cache holding REPO, set as huggingface_hub's cache, downloads off."""
    root = tmp_path / "hub"
    shutil.copytree(tiny_model, snapshot(root))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(root))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return root


def test_hub_id_shape() -> None:
    assert all(map(is_hub_id, ["Qwen/Qwen3-0.6B", "meta-llama/Llama-3.2-1B-Instruct", "a/b.c_d"]))
    assert not any(map(is_hub_id, ["smollm2-135m-instruct", "/abs/path", "a/b/c", "org/model.gguf",
                                    "./x", "a/..", "org/", "org name/x"]))


def test_cached_hub_id_loads_offline(cache: Path, tiny_model: Path) -> None:
    folder = prepare_model(REPO, cache_dir=cache.parent / "pdserve")
    assert folder == snapshot(cache)
    cfg = ModelConfig.from_dir(folder)
    assert cfg == ModelConfig.from_dir(tiny_model) and Tokenizer.from_dir(folder).vocab_size == 49152
    assert load_weights(folder, cfg, torch.float32).embed.shape == (256, 64)
    # what `dtype: auto` reads at app build, from the cache alone
    assert stored_dtype(REPO) == cfg.checkpoint_dtype == torch.float32
    assert stored_dtype("tiny-org/not-cached") is None


def test_hf_home_from_the_environment(tmp_path: Path, tiny_model: Path) -> None:
    shutil.copytree(tiny_model, snapshot(tmp_path / "home" / "hub"))
    env = {**os.environ, "HF_HOME": str(tmp_path / "home"), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    code = f"from engine.loading.bundled import prepare_model; print(prepare_model({REPO!r}, progress=False))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120, check=True)
    assert Path(out.stdout.strip()) == snapshot(tmp_path / "home" / "hub")


def test_an_id_not_in_the_cache_is_named(cache: Path) -> None:
    with pytest.raises(ModelLoadError) as e:
        prepare_model("tiny-org/Absent-Model")
    msg = str(e.value)
    assert "'tiny-org/Absent-Model'" in msg and str(cache) in msg and "HF_HUB_OFFLINE=1" in msg


def test_missing_files_are_named(cache: Path) -> None:
    folder = snapshot(cache)
    (folder / "model.safetensors").unlink()
    (folder / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match=f"{REPO}.*lacks tokenizer.json, model.safetensors.*HF_HUB_OFFLINE"):
        prepare_model(REPO)
    index = {"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors",
                                            "b": "model-00002-of-00002.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match=r"model-00001-of-00002\.safetensors, model-00002-of-00002"):
        prepare_model(REPO)


def test_a_local_folder_of_that_shape_wins(cache: Path, tiny_model: Path, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    shutil.copytree(tiny_model, tmp_path / REPO)
    monkeypatch.chdir(tmp_path)
    assert prepare_model(REPO) == Path(REPO)


def test_online_fetches_metadata_then_only_the_indexed_shards(tmp_path: Path, tiny_model: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The request pattern of a download (the hub itself is out of reach): two narrow snapshot calls."""
    folder = snapshot(tmp_path / "hub")
    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    calls: list[tuple[list[str], Any]] = []

    def fake_download(repo_id: str, *, allow_patterns: list[str], tqdm_class: Any) -> str:
        assert repo_id == REPO
        calls.append((allow_patterns, tqdm_class))
        folder.mkdir(parents=True, exist_ok=True)
        for name in allow_patterns:
            if name == "model.safetensors.index.json":
                (folder / name).write_text(json.dumps({"weight_map": {"x": shards[1], "y": shards[0]}}))
            elif (tiny_model / name).is_file() or name in shards:
                shutil.copyfile(tiny_model / (name if name not in shards else "model.safetensors"), folder / name)
        return str(folder)

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    assert prepare_model(REPO, progress=True) == folder
    assert [c[0] for c in calls] == [list(METADATA_FILES), shards] and calls[0][1] is None  # hub's own bars
    calls.clear()
    assert prepare_model(REPO, progress=False) == folder
    assert [c[0] for c in calls] == [list(METADATA_FILES)]  # the weights are there: one call
    assert calls[0][1](total=1).disable
