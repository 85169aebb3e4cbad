"""The packages' dependency rule, read from the source: the two pools never import each other, and
only the CLI and the Serve entry point import `cluster` (DESIGN: router → pools → kv_transfer → engine)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "kv_transfer", "prefill_worker", "decode_worker", "router", "cluster")
#: package → the packages it must not import
FORBIDDEN = {
    "engine": {"kv_transfer", "prefill_worker", "decode_worker", "router", "cluster"},
    "kv_transfer": {"prefill_worker", "decode_worker", "router", "cluster"},
    "prefill_worker": {"decode_worker", "router", "cluster"},
    "decode_worker": {"prefill_worker", "router", "cluster"},
    "router": {"cluster"},
}


def imported_packages(path: Path) -> set[tuple[str, int]]:
    """Top-level packages of ours that ``path`` imports (anywhere in it, TYPE_CHECKING included)."""
    found: set[tuple[str, int]] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        found.update((n.split(".")[0], node.lineno) for n in names if n.split(".")[0] in PACKAGES)
    return found


def test_no_package_imports_against_the_dependency_direction() -> None:
    bad = []
    for pkg, forbidden in FORBIDDEN.items():
        for path in sorted((REPO / pkg).rglob("*.py")):
            bad += [f"{path.relative_to(REPO)}:{line} imports {dep}"
                    for dep, line in imported_packages(path) if dep in forbidden]
    assert not bad, "\n".join(bad)


def test_the_walker_sees_every_form_of_import(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text("import engine.config\nfrom prefill_worker.types import X\nfrom . import y\n"
                   "if TYPE_CHECKING:\n    from decode_worker import worker\nimport os\n")
    assert {dep for dep, _ in imported_packages(src)} == {"engine", "prefill_worker", "decode_worker"}
