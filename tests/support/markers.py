"""Markers for tests that need something only some machines have."""

from __future__ import annotations

import os
import shutil

import pytest

#: inductor (`engine.kernels.compiled_attention`) and `engine.kernels.native_attention` compile C++ at runtime:
#: only where a compiler exists.
needs_cxx = pytest.mark.skipif(
    not any(shutil.which(c) for c in (os.environ.get("CXX", "g++"), "g++", "c++", "clang++")),
    reason="no C++ compiler for torch.compile's inductor backend",
)
