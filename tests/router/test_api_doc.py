"""docs/api.md's field tables against the code: `router/fields.py` and the endpoints' request models.

Each table in docs/api.md whose first column is ``field`` has one column per endpoint body (named in its
header, mapped to the pydantic model that endpoint validates with) and a notes column. A cell is
``served``, ``refused``, ``ignored`` or ``–`` (the field does not exist there). The checks run both
ways, so the page cannot drift from the code:

- a column's ``served`` rows are exactly its model's fields;
- on the generation endpoints (the first table, which lists every field), ``refused`` rows are exactly
  `REFUSED` less the endpoint's own fields and ``ignored`` rows exactly `IGNORED`;
- on every other table, a ``refused`` or ``ignored`` row is in `REFUSED` / `IGNORED` and not served;
- ``–`` is only for a field the endpoint neither serves nor accounts for elsewhere (a served field of
  another endpoint).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import BaseModel

from router.fields import IGNORED, REFUSED
from router.protocol import ChatCompletionRequest, CompletionRequest
from router.tokenize import DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest

pytestmark = pytest.mark.timeout(30)

API_MD = Path(__file__).resolve().parents[2] / "docs" / "api.md"
MODELS: dict[str, type[BaseModel]] = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    "/tokenize (prompt)": TokenizeCompletionRequest,
    "/tokenize (messages)": TokenizeChatRequest,
    "/detokenize": DetokenizeRequest,
}
GENERATION = ("/v1/completions", "/v1/chat/completions")
STATUSES = ("served", "refused", "ignored", "–")

Table = dict[str, dict[str, str]]  # endpoint → field → status


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def field_tables(text: str) -> list[Table]:
    """Every markdown table of ``text`` headed ``| field | <endpoint> ... | notes |``."""
    tables: list[Table] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        head = _cells(lines[i]) if lines[i].startswith("|") else []
        if head[:1] != ["field"] or head[-1] != "notes":
            i += 1
            continue
        endpoints = head[1:-1]
        table: Table = {e: {} for e in endpoints}
        i += 2  # the header and its |---| row
        while i < len(lines) and lines[i].startswith("|"):
            row = _cells(lines[i])
            assert len(row) == len(head), f"docs/api.md: {lines[i]!r} has {len(row)} cells, not {len(head)}"
            name = row[0].strip("`")
            for endpoint, status in zip(endpoints, row[1:-1], strict=True):
                assert status in STATUSES, f"docs/api.md: {name} on {endpoint}: {status!r} is not one of {STATUSES}"
                assert name not in table[endpoint], f"docs/api.md: {name} listed twice"
                table[endpoint][name] = status
            i += 1
        tables.append(table)
    return tables


def _with(table: Table, endpoint: str, status: str) -> set[str]:
    return {name for name, s in table[endpoint].items() if s == status}


@pytest.fixture(scope="module")
def tables() -> list[Table]:
    found = field_tables(API_MD.read_text(encoding="utf-8"))
    assert found, "docs/api.md has no field table"
    for table in found:
        unknown = set(table) - set(MODELS)
        assert not unknown, f"docs/api.md: columns {sorted(unknown)} name no endpoint this test knows"
    return found


def test_the_generation_table_lists_every_field_of_the_code(tables: list[Table]) -> None:
    table = tables[0]
    assert tuple(table) == GENERATION
    for endpoint in GENERATION:
        served = set(MODELS[endpoint].model_fields)
        assert _with(table, endpoint, "served") == served, endpoint
        assert _with(table, endpoint, "refused") == set(REFUSED) - served, endpoint
        assert _with(table, endpoint, "ignored") == set(IGNORED), endpoint
        others = {f for e in GENERATION for f in MODELS[e].model_fields} - served - set(REFUSED)
        assert _with(table, endpoint, "–") == others, endpoint


def test_every_table_serves_exactly_its_models_fields(tables: list[Table]) -> None:
    seen: set[str] = set()
    for table in tables:
        for endpoint, rows in table.items():
            served = set(MODELS[endpoint].model_fields)
            assert _with(table, endpoint, "served") == served, endpoint
            assert _with(table, endpoint, "refused") <= set(REFUSED) - served, endpoint
            assert _with(table, endpoint, "ignored") <= set(IGNORED), endpoint
            assert not set(rows) & served - _with(table, endpoint, "served"), endpoint
            seen.add(endpoint)
    assert seen == set(MODELS), f"docs/api.md documents no field table for {sorted(set(MODELS) - seen)}"


def test_the_parser_reads_a_table_and_rejects_a_bad_cell() -> None:
    text = "| field | /detokenize | notes |\n|---|---|---|\n| `tokens` | served | ids |\n| `user` | ignored | x |\n"
    assert field_tables(text) == [{"/detokenize": {"tokens": "served", "user": "ignored"}}]
    with pytest.raises(AssertionError, match="is not one of"):
        field_tables(text.replace("| ignored |", "| maybe |"))
