"""Every link in README.md and docs/*.md resolves inside the repository.

A clone has nothing but the repository, so a relative link must name a file or folder in it (never
``../shared/...`` or anything above the root), and a ``#anchor`` must name a heading of its target
page, slugged as GitHub slugs headings. Web links (``https://``) are left alone; fenced code blocks
and inline code are not links. The README itself stays a five-minute read: at most 150 lines, with the
two set-up commands on its first screen.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"!?\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)


def prose(text: str) -> str:
    """``text`` without fenced code blocks and inline code spans."""
    return _CODE.sub("", _FENCE.sub("", text))


def links(text: str) -> list[str]:
    return _LINK.findall(prose(text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup and punctuation dropped, lower case, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"[`*_~]", "", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading anchor of ``page``, with GitHub's ``-1``, ``-2`` for repeats."""
    found: set[str] = set()
    counts: dict[str, int] = {}
    for heading in _HEADING.findall(_FENCE.sub("", page.read_text(encoding="utf-8"))):
        base = slug(heading)
        n = counts.get(base, 0)
        counts[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def broken(page: Path, root: Path = ROOT) -> list[str]:
    """What is wrong with each link of ``page`` (a page of the repository at ``root``), one line each."""
    problems: list[str] = []
    for target in links(page.read_text(encoding="utf-8")):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # https:, mailto:
            continue
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / unquote(path_part)).resolve() if path_part else page
        if not dest.is_relative_to(root):
            problems.append(f"{target}: outside the repository")
        elif not dest.exists():
            problems.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{target}: no heading #{anchor} in {dest.relative_to(root)}")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_resolves_inside_the_repository(page: Path) -> None:
    assert not broken(page), broken(page)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_page_names_a_file_outside_the_repository(page: Path) -> None:
    lines = [line for line in page.read_text(encoding="utf-8").splitlines() if "../shared" in line]
    assert not lines, lines


def test_the_readme_is_short_and_starts_with_the_two_commands() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines; move detail into docs/"
    first_screen = "\n".join(lines[:25])
    assert "make serve" in first_screen and "make test" in first_screen


def test_the_checks_catch_what_they_are_for(tmp_path: Path) -> None:
    drain = "6. Graceful drain (scale-down, redeploy, node drain)"
    assert slug(drain) == "6-graceful-drain-scale-down-redeploy-node-drain"
    assert slug("The `n` choices") == "the-n-choices"
    text = "# Top\n## Top\n[a](#top-1) [b](../../x.md) [c](nope.md) [d](#gone) `[e](f.md)` [g](https://x.org)\n"
    root = tmp_path / "repo"
    (root / "docs").mkdir(parents=True)
    (tmp_path / "x.md").write_text("# X\n", encoding="utf-8")  # exists, but outside the repository
    page = root / "docs" / "probe.md"
    page.write_text(text, encoding="utf-8")
    assert anchors(page) == {"top", "top-1"}
    assert broken(page, root) == ["../../x.md: outside the repository", "nope.md: no such file",
                                  "#gone: no heading #gone in docs/probe.md"]
