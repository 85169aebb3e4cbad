"""Suite-wide settings (small thread counts, no hub access, auth-free local Ray) and the fixtures of
more than one folder: one tiny random Llama on disk and a reference engine over it."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import pytest
import torch

from engine.config import EngineConfig
from engine.engine import Engine
from tests.support.models import make_tiny

torch.set_num_threads(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama (256-id vocabulary) for the in-process worker tests."""
    return make_tiny("llama", tmp_path_factory.mktemp("tiny-llama"), seed=3)


@pytest.fixture(scope="session")
def ref_engine(tiny_path: Path) -> Engine:
    """An engine over ``tiny_path``: what `tests.support.inprocess_pd.reference` generates with."""
    return Engine.from_dir(tiny_path, EngineConfig(num_blocks=64, block_size=16))
