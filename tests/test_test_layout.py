"""The test suite's own layout, read from the source: test folders mirror the packages, shared code
lives in `tests.support`, no test module imports another (a test module is not a library: what two
tests share is support code, with a docstring saying what it owns), and no exception becomes a skip."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
#: folders of tests/ that name no package, and why
NOT_PACKAGES = {
    "support": "the shared test code itself",
    "e2e": "whole request paths across packages (in-process P/D, a real Serve with the real model)",
    "reliability": "kills, disconnects, backpressure, timeouts, fuzzing, security and soak of a running app",
    "deploy": "the repository's deploy/ folder (YAMLs, KubeRay, Dockerfile, nginx) on a multi-node cluster",
}
#: what a test folder may hold besides support code
TEST_FOLDER_FILES = ("__init__.py", "conftest.py")


def imported_modules(path: Path, package: tuple[str, ...]) -> list[tuple[str, int]]:
    """Every module ``path`` imports, as a dotted name, relative imports resolved against ``package``
    (``from a import b`` yields ``a`` and ``a.b``: ``b`` may be a module)."""
    found: list[tuple[str, int]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = list(package[: len(package) - node.level + 1]) if node.level else []
            module = ".".join([*base, *(node.module.split(".") if node.module else [])])
            found.append((module, node.lineno))
            found += [(f"{module}.{a.name}", node.lineno) for a in node.names]
    return found


def imports_a_test_module(path: Path, package: tuple[str, ...]) -> list[str]:
    """``file:line imports module`` for each import of a ``test_*`` or ``conftest`` module."""
    bad = []
    for module, line in imported_modules(path, package):
        last = module.rsplit(".", 1)[-1]
        if last.startswith("test_") or last == "conftest":
            bad.append(f"{path}:{line} imports {module}")
    return bad


def test_no_test_module_imports_another_test_module() -> None:
    bad = [b for path in sorted(TESTS.rglob("*.py"))
           for b in imports_a_test_module(path, path.relative_to(REPO).parent.parts)]
    assert not bad, "move what they share to tests/support:\n" + "\n".join(bad)


def test_each_test_folder_names_a_package_or_a_justified_exception() -> None:
    folders = sorted(p for p in TESTS.iterdir() if p.is_dir() and not p.name.startswith((".", "__")))
    stray = [p.name for p in folders
             if p.name not in NOT_PACKAGES and not (REPO / p.name / "__init__.py").is_file()]
    assert not stray, f"tests/ folders that name no package: {stray} (rename, or justify in NOT_PACKAGES)"


def test_shared_test_code_lives_in_tests_support() -> None:
    stray = []
    for path in sorted(TESTS.rglob("*.py")):
        rel = path.relative_to(TESTS)
        if rel.parts[0] == "support" or path.name.startswith("test_") or path.name in TEST_FOLDER_FILES:
            continue
        stray.append(str(rel))
    assert not stray, f"helper modules outside tests/support: {stray}"


def skips_in_except_handlers(path: Path) -> list[str]:
    """``file:line`` of each ``pytest.skip`` / ``importorskip`` / ``xfail`` called in an ``except`` block:
    a skip there turns a failure into a skip (skips are for a named missing resource, checked up front)."""
    bad = []
    for handler in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(handler, ast.ExceptHandler):
            continue
        for node in ast.walk(handler):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("skip", "importorskip", "xfail")):
                bad.append(f"{path}:{node.lineno}")
    return bad


def test_no_skip_turns_an_exception_into_a_skip() -> None:
    bad = [b for path in sorted(TESTS.rglob("*.py")) for b in skips_in_except_handlers(path)]
    assert not bad, "\n".join(bad)


def test_the_skip_walker_sees_a_skip_in_an_except_block(tmp_path: Path) -> None:
    src = tmp_path / "probe.py"
    src.write_text("try:\n    load()\nexcept Exception as e:\n    if e:\n        pytest.skip(str(e))\n")
    assert skips_in_except_handlers(src) == [f"{src}:5"]
    src.write_text("if shutil.which('nginx') is None:\n    pytest.skip('needs nginx')\n")
    assert skips_in_except_handlers(src) == []


def test_the_walker_sees_every_form_of_import_of_a_test_module(tmp_path: Path) -> None:
    src = tmp_path / "probe.py"
    cases = {
        "from tests.router.test_router_generation import FakeHandle\n": True,
        "from tests.router import test_router_generation\n": True,
        "import tests.deploy.test_multinode\n": True,
        "from .test_router_codec import codec\n": True,
        "from . import test_router_codec\n": True,
        "from ..deploy.conftest import APP\n": True,
        "if TYPE_CHECKING:\n    from tests.reliability.test_soak import SoakRun\n": True,
        "def f():\n    from tests.workers import conftest\n": True,
        "from tests.support.pd_fakes import FakeCodec\n": False,
        "from . import pd_helpers\n": False,
        "import pytest\n": False,
    }
    for code, is_bad in cases.items():
        src.write_text(code)
        assert bool(imports_a_test_module(src, ("tests", "router"))) is is_bad, code
