"""Issue 38, item 3: durable writes, the whole-request bound and the request-body checks
each live in one module, and nothing else in ``sidecar/`` writes them out again."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "sidecar"

# (what, its one home, where it is looked for, a pattern that writes it out)
HOMES = [
    ("fsync", "checkpoint/durable.py", "", re.compile(r"\bos\.fsync\(")),
    # A cloud call waited for at most its bound (a thread joined, a timer that cuts it).
    ("the whole-request bound", "host/sources/bounded.py", "host/",
     re.compile(r"\.join\(\s*(self\.)?_?(call_)?(bound|seconds)|threading\.Timer\(")),
    ("the request-body cap", "host/json_body.py", "host/",
     re.compile(r"""headers\.get\(\s*["']content-length["']""")),
]


def _code(path: Path) -> str:
    """``path``'s source without its comments and docstring lines (the prose may name the
    calls)."""
    lines = []
    for line in path.read_text(encoding="utf-8").splitlines():
        stripped = line.lstrip()
        if stripped.startswith("#") or stripped.startswith('"') or stripped.startswith("``"):
            continue
        lines.append(line.split("  #")[0])
    return "\n".join(lines)


@pytest.mark.parametrize(("what", "home", "under", "pattern"), HOMES,
                         ids=[h[0] for h in HOMES])
def test_written_out_only_in_its_home(what: str, home: str, under: str,
                                      pattern: re.Pattern[str]) -> None:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative.startswith("tools/") or not relative.startswith(under):
            continue  # tools/: not the product (the simulator, the demo)
        if pattern.search(_code(path)):
            found.append(relative)
    assert found == [home], f"{what} written out outside {home}: {found}"
