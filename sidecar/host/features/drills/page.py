"""The last fire drills on the status page: verdict, figures, reason."""

from __future__ import annotations

from typing import Any, Optional

from sidecar.host.page_parts import ago as _ago
from sidecar.host.page_parts import escape as _e
from sidecar.host.page_parts import seconds as _seconds

__all__ = ["drills_section"]


def drills_section(drills: Optional[dict[str, Any]], now: float) -> str:
    """The last fire drills (``GET /v1/drill``): verdict, figures, reason."""
    listed = (drills or {}).get("drills") or []
    if not listed:
        return ""
    rows = []
    for drill in listed[:5]:
        figures = drill.get("figures") or {}
        verdict = drill.get("verdict") or drill.get("state")
        css = "bad" if verdict == "FAIL" else ""
        numbers = ", ".join(f"{label} {_seconds(figures[key])}" for key, label in (
            ("budget_seconds", "budget"), ("save_seconds", "save"),
            ("upload_seconds", "upload"), ("durable_seconds", "durable after"))
            if figures.get(key) is not None)
        rows.append(f"<tr class=\"drill-row\"><td>{_e(drill.get('id'))}</td>"
                    f"<td>{_ago(now, drill.get('started_at_unix'))}</td>"
                    f"<td class=\"{css}\">{_e(verdict)}</td><td>{_e(figures.get('step'))}</td>"
                    f"<td>{_e(numbers)}</td><td>{_e(drill.get('reason') or '')}</td></tr>")
    return ("<h2>Fire drills</h2><table id=\"drills\"><tr><th>drill</th><th>started</th>"
            "<th>verdict</th><th>step</th><th>figures</th><th>why</th></tr>"
            + "".join(rows) + "</table>")
