"""Shared fixtures for the engine tests: the bundled model, converted once into the default cache.

The conversion takes a few seconds and ~540 MB of disk; using the default cache directory lets every
later test run (and every other test module) reuse it instead of converting again.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.models import bundled_tokenizer_dir


@pytest.fixture(scope="session")
def smollm_dir() -> Path:
    """Hugging Face folder of the bundled SmolLM2-135M-Instruct (fp32 safetensors + tokenizer)."""
    return bundled_tokenizer_dir()
