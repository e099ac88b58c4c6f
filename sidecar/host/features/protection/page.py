"""The protection verdicts on the status page: a row per running source."""

from __future__ import annotations

from typing import Any, Optional

from sidecar.host.page_parts import escape as _e
from sidecar.host.page_parts import seconds as _seconds

__all__ = ["protection_section"]


def protection_section(protection: Optional[dict[str, Any]]) -> str:
    """Per running source: does its notice hold the job's step + save + upload?"""
    if not protection or not protection.get("sources"):
        return ""
    rows = []
    for verdict in protection["sources"]:
        status = str(verdict.get("status"))
        css = {"protected": "", "not-protected": "bad", "not-working": "bad"}.get(status, "muted")
        notice = verdict.get("notice_seconds")
        rows.append(f"<tr class=\"verdict\" data-status=\"{_e(status)}\"><td>"
                    f"{_e(verdict.get('source'))}</td><td>"
                    f"{'ahead' if notice is None else _seconds(notice)}</td>"
                    f"<td class=\"{css}\">{_e(status)}</td><td>{_e(verdict.get('reason'))}"
                    "</td></tr>")
    return ("<h2>Protection</h2><table id=\"protection\"><tr><th>source</th><th>notice</th>"
            "<th>verdict</th><th>why</th></tr>" + "".join(rows) + "</table>")
