"""The job's checkpoints on the status page: its saves and their durability."""

from __future__ import annotations

from typing import Any, Optional

from sidecar.host.page_parts import ago as _ago
from sidecar.host.page_parts import escape as _e
from sidecar.host.page_parts import event_time as _at
from sidecar.host.page_parts import human_duration
from sidecar.host.page_parts import seconds as _seconds

__all__ = ["saves_section"]


def saves_section(events: Optional[dict[str, Any]], now: float) -> str:
    listed = [e for e in (events or {}).get("events", ())
              if e.get("kind") in ("save-finished", "durable")][:20]
    if not listed:
        return ""
    rows = []
    for event in listed:
        if event["kind"] == "durable":
            lead = event.get("lead_seconds")
            until = "the drill deadline" if event.get("save") == "drill" else "the release"
            what = "durable" + ("" if lead is None else
                                f", {human_duration(abs(lead))} "
                                f"{'before' if lead >= 0 else 'after'} {until}")
        else:
            what = (f"{_e(event.get('save') or 'routine')} save, "
                    f"{_seconds(event.get('seconds'))}"
                    f"{' (asynchronous)' if event.get('asynchronous') else ''}")
        rows.append(f"<tr class=\"save-row\"><td>{_ago(now, _at(event))}</td>"
                    f"<td>{_e(event.get('step'))}</td><td>{what}</td></tr>")
    return ("<h2>Checkpoints</h2><table id=\"saves\"><tr><th>when</th><th>step</th>"
            "<th>what</th></tr>" + "".join(rows) + "</table>")
