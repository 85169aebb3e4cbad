"""constraints-dev.txt against pyproject.toml and the venv: every dependency the project names has one
exact pin there, inside the floor pyproject.toml gives it, and the oracles the tests compare against are
the pinned versions (a different oracle makes a green or red result mean something else)."""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
#: what the tests take their expected values from
ORACLES = ("transformers", "tokenizers", "openai", "jsonschema", "hypothesis", "schemathesis", "regex", "jinja2")


def pins() -> dict[str, Version]:
    out: dict[str, Version] = {}
    for line in (ROOT / "constraints-dev.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        req = Requirement(line)
        specs = list(req.specifier)
        assert len(specs) == 1 and specs[0].operator == "==", f"constraints-dev.txt: {line!r} is not an exact pin"
        name = canonicalize_name(req.name)
        assert name not in out, f"constraints-dev.txt pins {req.name} twice"
        out[name] = Version(specs[0].version)
    return out


def declared() -> list[Requirement]:
    """The runtime dependencies and the dev extra of pyproject.toml."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [Requirement(r) for r in (*project["dependencies"], *project["optional-dependencies"]["dev"])]


def test_every_declared_dependency_is_pinned_inside_its_floor() -> None:
    pinned = pins()
    for req in declared():
        name = canonicalize_name(req.name)
        assert name in pinned, f"pyproject.toml names {req.name}, constraints-dev.txt does not pin it"
        assert req.specifier.contains(pinned[name], prereleases=True), \
            f"constraints-dev.txt pins {req.name}=={pinned[name]}, outside pyproject.toml's {req.specifier}"


@pytest.mark.parametrize("name", ORACLES)
def test_the_installed_oracles_are_the_pinned_ones(name: str) -> None:
    pinned = pins()[canonicalize_name(name)]
    installed = Version(metadata.version(name))
    assert installed == pinned, (f"{name} {installed} is installed, constraints-dev.txt pins {pinned}: the tests "
                                 f"compare against the pinned one (make install, or re-pin with make constraints)")
