"""Markers for tests that need something only some machines have, and the rule for when it is missing.

A resource the suite expects (a C++ compiler for the native kernels, nginx for the load-balancer test)
is named by a `Resource`: how to find it and how to install it. A test asks for one with
``@pytest.mark.resource(CXX)`` (or ``needs_cxx``), or calls `require` from a fixture. Where it is missing:

- on a developer's machine the test skips with a reason naming the resource and how to install it;
- under ``PDSERVE_REQUIRE_RESOURCES=1`` (`.ci/run` sets it) the test fails with that same message, so CI
  cannot go green while coverage quietly drops.

Invariant: a resource check never decides on an exception's text; it looks for the tool up front.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

#: Set to 1 where every resource the suite expects must be present (CI).
REQUIRE_ENV = "PDSERVE_REQUIRE_RESOURCES"


@dataclass(frozen=True)
class Resource:
    """A tool some tests need: ``find`` returns its path or None; ``install`` says how to get it."""

    name: str
    find: Callable[[], str | None]
    install: str

    def missing_message(self) -> str:
        return f"needs {self.name}, not found here (install: {self.install})"


def _find_cxx() -> str | None:
    return next((p for c in (os.environ.get("CXX", "g++"), "g++", "c++", "clang++") if (p := shutil.which(c))), None)


def _find_nginx() -> str | None:
    return shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx",) if Path(p).is_file()), None)


#: inductor (`engine.kernels.compiled_attention`) and `engine.kernels.native_*` compile C++ at runtime.
CXX = Resource("a C++ compiler (g++)", _find_cxx, "apt-get install g++, or set CXX to a compiler")
#: tests/deploy/test_nginx.py runs deploy/nginx.conf in front of a local cluster.
NGINX = Resource("nginx", _find_nginx, "scripts/ci-deps.sh, i.e. apt-get install nginx as root")


def resources_required() -> bool:
    return os.environ.get(REQUIRE_ENV, "") == "1"


def require(resource: Resource) -> str:
    """The resource's path; where it is missing, skip the test, or fail it under ``PDSERVE_REQUIRE_RESOURCES=1``."""
    found = resource.find()
    if found is not None:
        return found
    if resources_required():
        pytest.fail(f"{resource.missing_message()}; {REQUIRE_ENV}=1 makes a missing resource a failure",
                    pytrace=False)
    pytest.skip(resource.missing_message())


def check_resource_marks(item: pytest.Item) -> None:
    """`require` each ``@pytest.mark.resource(...)`` of ``item`` (run from tests/conftest.py before setup)."""
    for mark in item.iter_markers("resource"):
        for resource in mark.args:
            require(resource)


needs_cxx = pytest.mark.resource(CXX)
