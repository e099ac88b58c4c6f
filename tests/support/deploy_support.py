"""The systemd unit the deploy and hostile-connection tests read, and its directives."""

from __future__ import annotations

from pathlib import Path
from typing import Any

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


def validate_kubernetes(documents: list[dict[str, Any]], version: str = "1.30") -> None:
    """Each document against the Kubernetes schema of that version, unknown fields refused
    (the manifest's and the Helm chart's check; kubernetes-validate is in the test extra)."""
    import kubernetes_validate  # type: ignore[import-not-found]

    for document in documents:
        kubernetes_validate.validate(document, version, strict=True)
