"""The systemd unit the deploy and hostile-connection tests read, and its directives."""

from __future__ import annotations

from pathlib import Path

UNIT = Path(__file__).resolve().parents[2] / "deploy" / "esi-sidecar.service"


def unit_directives(text: str) -> dict[str, list[str]]:
    """'Section.Key' -> every value, in order (systemd allows repeated keys)."""
    found: dict[str, list[str]] = {}
    section = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        found.setdefault(f"{section}.{key.strip()}", []).append(value.strip())
    return found
