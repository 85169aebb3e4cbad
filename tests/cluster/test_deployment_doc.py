"""docs/deployment.md's table of the YAML's keys against `ClusterConfig`, both ways.

The table headed ``| key | sections | what it sets |`` names each key (backticked) and the sections it
is a key of (``top level`` for `ClusterConfig`'s own). The pairs it lists must be exactly the config's
(section, field) pairs; a key whose value is itself a section (``placement``, ``autoscaling``, ...) must
name each of that section's keys in its row.
"""

from __future__ import annotations

import re
import types
import typing
from pathlib import Path

from pydantic import BaseModel

from cluster.config import ClusterConfig

DEPLOYMENT_MD = Path(__file__).resolve().parents[2] / "docs" / "deployment.md"
TOP = "top level"


def _section_type(annotation: object) -> type[BaseModel] | None:
    """The pydantic model a field holds (through ``X | None``), or None for a plain value."""
    options = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
    models = [o for o in options if isinstance(o, type) and issubclass(o, BaseModel)]
    return models[0] if models else None


def config_keys() -> dict[tuple[str, str], type[BaseModel] | None]:
    """(section, key) → the model a key's value is, for every key of a Serve YAML's ``args:``."""
    keys: dict[tuple[str, str], type[BaseModel] | None] = {}
    for name, field in ClusterConfig.model_fields.items():
        section = _section_type(field.annotation)
        if section is None:
            keys[(TOP, name)] = None
            continue
        for key, sub in section.model_fields.items():
            keys[(name, key)] = _section_type(sub.annotation)
    return keys


def documented_keys(text: str) -> dict[tuple[str, str], str]:
    """(section, key) → its row's text, from the table headed ``| key | sections | what it sets |``."""
    rows: dict[tuple[str, str], str] = {}
    inside = False
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        if cells[:3] == ["key", "sections", "what it sets"]:
            inside = True
        elif not cells:
            inside = False
        elif inside and not set(cells[0]) <= set("-: "):
            for key in re.findall(r"`([^`]+)`", cells[0]):
                for section in (s.strip() for s in cells[1].split(",")):
                    assert (section, key) not in rows, f"docs/deployment.md lists {section}.{key} twice"
                    rows[(section, key)] = cells[2]
    return rows


def test_the_key_table_is_the_config() -> None:
    documented = documented_keys(DEPLOYMENT_MD.read_text(encoding="utf-8"))
    expected = config_keys()
    assert sorted(set(expected) - set(documented)) == [], "keys of ClusterConfig missing from docs/deployment.md"
    assert sorted(set(documented) - set(expected)) == [], "keys in docs/deployment.md that ClusterConfig lacks"
    for pair, section in expected.items():
        if section is not None:
            missing = [k for k in section.model_fields if f"`{k}`" not in documented[pair]]
            assert not missing, f"{pair}: its row does not name {missing}"


def test_the_reader_expands_keys_and_sections() -> None:
    text = "| key | sections | what it sets |\n|---|---|---|\n| `a`, `b` | kv, limits | x |\n\n| `c` | kv | y |\n"
    assert set(documented_keys(text)) == {("kv", "a"), ("kv", "b"), ("limits", "a"), ("limits", "b")}
