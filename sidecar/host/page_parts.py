"""The status page's small helpers, shared by the page (``sidecar.host.page``) and the
features' sections of it (``sidecar.host.features.*.page``): durations, times, escaping."""

from __future__ import annotations

import html
import math
from typing import Any, Optional

from sidecar.timeparse import format_rfc3339

__all__ = ["ago", "escape", "event_time", "human_duration", "seconds", "when"]


def human_duration(seconds: float) -> str:
    """``1 h 02 min 03 s``, ``4 min 05 s``, ``7 s``: what the script writes too."""
    whole = max(0, math.floor(seconds))
    hours, minutes, rest = whole // 3600, whole % 3600 // 60, whole % 60
    parts = []
    if hours:
        parts.append(f"{hours} h")
    if hours or minutes:
        parts.append(f"{minutes:02d} min" if hours else f"{minutes} min")
    parts.append(f"{rest:02d} s" if hours or minutes else f"{rest} s")
    return " ".join(parts)


def when(unix: Optional[float]) -> str:
    """A time to the second, in UTC: ``2026-12-01 14:53:31Z``."""
    if unix is None:
        return "—"
    return html.escape(format_rfc3339(float(round(unix))).replace("T", " "))


def ago(now: float, unix: Optional[float]) -> str:
    if unix is None:
        return "never"
    age = now - unix
    return f"{human_duration(age)} ago" if age >= 0 else f"in {human_duration(-age)}"


def escape(value: Any) -> str:
    return html.escape("" if value is None else str(value))


def seconds(value: Any) -> str:
    return "?" if value is None else f"{float(value):.1f} s"


def event_time(event: dict[str, Any]) -> float:
    """When a job event happened (its own time, else when the daemon received it)."""
    return float(event.get("at_unix") or event.get("received_at_unix") or 0.0)
