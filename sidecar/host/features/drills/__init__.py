"""Fire drills: a deadline the job saves for and trains through (docs/drill.md).

The board (``board``) keeps one drill at a time and its verdict, from the guards' drill
reports among the job events; ``api`` serves ``POST``/``GET /v1/drill`` and the metrics;
``/v1/expiry`` carries the drill under way as its ``drill`` object.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

from sidecar.host.features import Feature, Needs, PageSection, Part
from sidecar.host.features.drills.api import DrillCollector, add_drill_routes, report_drills
from sidecar.host.features.drills.board import DrillBoard
from sidecar.host.features.drills.page import drills_section
from sidecar.host.features.events import EventHistory
from sidecar.models import Expiry

__all__ = ["FEATURE", "DrillBoard"]


def build(needs: Needs) -> Optional[Part]:
    events = needs.owner("events", EventHistory)
    if events is None:  # a drill is judged from the guards' reports among the events
        return None
    board = DrillBoard()  # in memory: a restart leaves no drill behind
    events.listen(lambda batch, now: report_drills(board, batch, now))

    def real_deadline(now: float) -> Optional[float]:
        return needs.store.expiry(now).expires_at_unix

    def served(expiry: Expiry, now: float) -> Expiry:
        drill = board.served(expiry.expires_at_unix, now)
        return expiry if drill is None else replace(expiry, drill=drill)

    return Part(owner=board, expiry=served, metrics=DrillCollector(board, needs.clock),
                routes=lambda app: add_drill_routes(app, board, events, real_deadline,
                                                    needs.clock, needs.token),
                page=lambda now, expiry: board.body(expiry["expires_at_unix"], now))


FEATURE = Feature("drills", build, PageSection(110, drills_section))
