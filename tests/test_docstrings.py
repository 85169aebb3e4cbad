"""Docstrings (and the C++ kernels' comments) say what and why, never a measured figure, a machine or
what was tried: those go stale with the next kernel, and live in docs/benchmarks-notes.md and results/."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "cluster", "router", "prefill_worker", "decode_worker", "kv_transfer")
#: a timing or a rate, a CPU by name, history
FIGURE = re.compile(r"\d\s?(ms|µs|GB/s|GFLOP/s|tok/s|req/s)\b|\b(Xeon|EPYC|Ryzen|Graviton)\b|\btried and dropped\b",
                    re.IGNORECASE)


def docstring_figures(path: Path) -> list[str]:
    """``file:name: match`` for each module, class or function docstring of ``path`` that holds a figure."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = ast.get_docstring(node, clean=False)
            if doc and (m := FIGURE.search(doc)):
                found.append(f"{path.name}:{getattr(node, 'name', '<module>')}: {m.group(0)!r}")
    return found


def comment_figures(path: Path) -> list[str]:
    """``file:line: match`` for each ``//`` comment of ``path`` that holds a figure."""
    return [f"{path.name}:{n}: {m.group(0)!r}" for n, line in enumerate(path.read_text().splitlines(), 1)
            if "//" in line and (m := FIGURE.search(line.split("//", 1)[1]))]


def test_no_docstring_carries_a_figure_a_machine_or_history() -> None:
    found = [f for pkg in PACKAGES for path in sorted((ROOT / pkg).rglob("*.py")) for f in docstring_figures(path)]
    assert not found, "move these to docs/benchmarks-notes.md:\n" + "\n".join(found)


def test_no_kernel_comment_carries_a_figure_a_machine_or_history() -> None:
    csrc = ROOT / "engine" / "kernels" / "csrc"
    found = [f for path in sorted(csrc.iterdir()) for f in comment_figures(path)]
    assert not found, "move these to docs/benchmarks-notes.md:\n" + "\n".join(found)


def test_the_scans_see_figures(tmp_path: Path) -> None:
    src = tmp_path / "probe.py"
    src.write_text('"""Fast: 4.7 ms a layer."""\n\n\nclass A:\n    """Reads 24 GB/s on an EPYC."""\n\n\n'
                   'def f():\n    """A 2 MiB page, a 30 s lease: sizes and settings, not figures."""\n')
    assert docstring_figures(src) == ["probe.py:<module>: '7 ms'", "probe.py:A: '4 GB/s'"]
    cpp = tmp_path / "probe.h"
    cpp.write_text("int x = 1;  // 16 lanes\n// Tried and dropped: vdpbf16ps\n")
    assert comment_figures(cpp) == ["probe.h:2: 'Tried and dropped'"]
