"""A page opens with what it answers, not with the project's history: no document's title
and first paragraph cite an internal issue (issue 39: docs/protection.md did)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = sorted([REPO / "README.md", *(REPO / "docs").glob("*.md")])


def opening(text: str) -> str:
    """The title and the first paragraph after it."""
    paragraphs = [part for part in re.split(r"\n\s*\n", text) if part.strip()]
    return "\n\n".join(paragraphs[:2])


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_a_page_opens_without_an_issue_reference(page: Path) -> None:
    found = re.search(r"\bissues? \d+", opening(page.read_text()), re.I)
    assert found is None, f"{page.name} opens with {found.group(0)!r}"
