"""The uploads on the status page: their state and the last durable step."""

from __future__ import annotations

from typing import Any, Optional

from sidecar.host.page_parts import ago as _ago
from sidecar.host.page_parts import escape as _e

__all__ = ["uploads_section"]


def uploads_section(uploads: Optional[dict[str, Any]], now: float) -> str:
    if uploads is None or not uploads.get("enabled"):
        return ("<h2>Uploads</h2><p class=\"muted\" id=\"uploads\">No uploader on this daemon "
                "(--upload-to): a checkpoint on local disk goes with the machine.</p>")
    status = uploads.get("status") or "ok"
    css = "bad" if uploads.get("degraded") else ""
    error = uploads.get("error")
    step = uploads.get("last_durable_step")
    rows = []
    for item in (uploads.get("checkpoints") or [])[:10]:
        rows.append(f"<tr><td>{_e(item.get('name'))}</td><td>{_e(item.get('state'))}</td>"
                    f"<td>{_e(item.get('progress') or item.get('bytes_done') or '')}</td></tr>")
    table = ("<table><tr><th>checkpoint</th><th>state</th><th>progress</th></tr>"
             + "".join(rows) + "</table>") if rows else ""
    return (f"<h2>Uploads</h2><p id=\"uploads\"><span class=\"{css}\">{_e(status)}</span>"
            f"{' — ' + _e(error) if error else ''}; last durable step "
            f"{_e(step) if step is not None else 'none'} "
            f"({_ago(now, uploads.get('last_durable_at_unix'))})</p>{table}")
