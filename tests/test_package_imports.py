"""The packages' dependency rule, read from the source: the two pools never import each other, and
only the CLI and the Serve entry point import `cluster` (docs/architecture.md: router → pools → kv_transfer
→ engine)."""

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


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, known: set[str]) -> set[str]:
    """Modules of ours (from ``known``) that ``path`` imports, anywhere in it: ``from a import b``
    names module ``a.b`` where that is one, else ``a``."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            candidates = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            candidates = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
        else:
            continue
        for name in candidates:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
                if isinstance(node, ast.ImportFrom):
                    break  # the first candidate that is a module of ours: `from a import b` is not also `a`
    return found


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle per strongly connected group of two or more modules (or a module importing itself)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if dep not in index:
                visit(dep)
                low[node] = min(low[node], low[dep])
            elif dep in stack:
                low[node] = min(low[node], index[dep])
        if low[node] == index[node]:
            group = [stack.pop()]
            while group[-1] != node:
                group.append(stack.pop())
            if len(group) > 1 or node in graph.get(node, ()):
                circles.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return circles


def test_no_import_circle_between_modules_of_one_package() -> None:
    bad = []
    for pkg in PACKAGES:
        paths = sorted((REPO / pkg).rglob("*.py"))
        known = {module_name(p) for p in paths}
        graph = {module_name(p): {m for m in imported_modules(p, known) if m != module_name(p)} for p in paths}
        bad += [" <-> ".join(group) for group in import_circles(graph)]
    assert not bad, "modules that import each other (TYPE_CHECKING and lazy imports count):\n" + "\n".join(bad)


def test_the_circle_finder_sees_a_circle_through_a_type_checking_import(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("from pkg.b import B\n")
    (tmp_path / "pkg" / "b.py").write_text("if TYPE_CHECKING:\n    from pkg import a\nimport os\n")
    (tmp_path / "pkg" / "c.py").write_text("import pkg.a\n")
    known = {"pkg.a", "pkg.b", "pkg.c"}
    graph = {m: imported_modules(tmp_path / "pkg" / f"{m[4:]}.py", known) for m in known}
    assert graph == {"pkg.a": {"pkg.b"}, "pkg.b": {"pkg.a"}, "pkg.c": {"pkg.a"}}
    assert import_circles(graph) == [["pkg.a", "pkg.b"]]
