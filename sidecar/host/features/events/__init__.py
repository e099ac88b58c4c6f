"""Job events: what the jobs on this node say (``POST``/``GET /v1/events``, docs/events.md).

Kept in a bounded history (``history``), a section of the state file; the page shows the
job's checkpoints (``page``). Other features read the history (``EventHistory``) and the
guard's drill report (``DrillReport``) from here.
"""

from __future__ import annotations

from sidecar.host.features import Feature, Needs, PageSection, Part
from sidecar.host.features.events.drill_report import DrillReport
from sidecar.host.features.events.history import EventHistory, JobEvent
from sidecar.host.features.events.page import saves_section
from sidecar.host.features.events.routes import add_event_routes

__all__ = ["FEATURE", "DrillReport", "EventHistory", "JobEvent"]


def build(needs: Needs) -> Part:
    history = EventHistory(clock=needs.clock, on_change=needs.on_change)
    return Part(owner=history, routes=lambda app: add_event_routes(app, history, needs.clock),
                metrics=history, page=lambda now, _expiry: history.body(limit=50, now=now),
                state=history)


FEATURE = Feature("events", build, PageSection(80, saves_section))
