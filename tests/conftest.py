"""Suite-wide settings (small thread counts, no hub access, auth-free local Ray, hypothesis's fixed
profile) and the fixtures of more than one folder: one tiny random Llama on disk and a reference
engine over it.

Hypothesis runs the ``ci`` profile unless ``pytest --hypothesis-profile=explore`` names the other one:
``ci`` is derandomized with no example database, so every run draws the same examples (a red test is
red because the code changed, and its failure reproduces); ``explore`` draws new examples each run and
keeps failures in the local database, for hunting bugs by hand. A test's own ``@settings`` still sets
its example count and health checks on top of the profile."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import pytest
import torch
from hypothesis import settings

from engine.config import EngineConfig
from engine.engine import Engine
from tests.support.markers import check_resource_marks
from tests.support.models import make_tiny

torch.set_num_threads(1)

settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile("ci")  # the hypothesis plugin's --hypothesis-profile, read later, overrides it


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_runtest_setup(item: pytest.Item) -> None:
    check_resource_marks(item)  # a missing g++ / nginx: a skip here, a failure under PDSERVE_REQUIRE_RESOURCES=1


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama (256-id vocabulary) for the in-process worker tests."""
    return make_tiny("llama", tmp_path_factory.mktemp("tiny-llama"), seed=3)


@pytest.fixture(scope="session")
def ref_engine(tiny_path: Path) -> Engine:
    """An engine over ``tiny_path``: what `tests.support.inprocess_pd.reference` generates with."""
    return Engine.from_dir(tiny_path, EngineConfig(num_blocks=64, block_size=16))
