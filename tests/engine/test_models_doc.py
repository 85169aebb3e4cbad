"""docs/models.md's family table names exactly the architectures `engine.model.families` runs.

The table's ``architectures`` column is read back and compared with `SUPPORTED_ARCHITECTURES` both
ways, so a family added to the registry and not to the page (or the other way round) fails here.
"""

from __future__ import annotations

import re
from pathlib import Path

from engine.model.families import SUPPORTED_ARCHITECTURES

MODELS_MD = Path(__file__).resolve().parents[2] / "docs" / "models.md"


def documented_architectures(text: str) -> set[str]:
    """The backticked names in the ``architectures`` column of the table headed ``| family | architectures``."""
    found: set[str] = set()
    column: int | None = None
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        if not cells:
            column = None
        elif column is None and "`architectures`" in cells:
            column = cells.index("`architectures`")
        elif column is not None and not set(cells[column]) <= set("-: "):
            found.update(re.findall(r"`([^`]+)`", cells[column]))
    return found


def test_the_family_table_names_every_supported_architecture() -> None:
    assert documented_architectures(MODELS_MD.read_text(encoding="utf-8")) == set(SUPPORTED_ARCHITECTURES)


def test_the_reader_sees_only_that_column() -> None:
    text = "| a | `architectures` | b |\n|---|---|---|\n| x | `FooForCausalLM` | `not_this` |\n\n| `Bar` |\n"
    assert documented_architectures(text) == {"FooForCausalLM"}
