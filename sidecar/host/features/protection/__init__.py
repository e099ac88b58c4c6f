"""Each running source's protection verdict: does its notice hold the job's step + save +
upload? (``GET /v1/protection``, the metrics, a line when one changes; docs/protection.md).
"""

from __future__ import annotations

from sidecar.host.features import Feature, Needs, PageSection, Part
from sidecar.host.features.events import EventHistory
from sidecar.host.features.protection.api import add_protection_routes
from sidecar.host.features.protection.board import ProtectionBoard, notice_table
from sidecar.host.features.protection.page import protection_section

__all__ = ["FEATURE", "ProtectionBoard"]


def build(needs: Needs) -> Part:
    board = ProtectionBoard(
        needs.store, notice_table(needs.notices, needs.notice_overrides),
        events=needs.owner("events", EventHistory), uploads=needs.uploads, clock=needs.clock,
        # gcp on GKE: 15 s, unless --notice says
        detected={s.name: s for s in needs.sources
                  if hasattr(s, "notice_seconds") and s.name not in needs.notice_overrides})
    return Part(owner=board, routes=lambda app: add_protection_routes(app, board, needs.clock),
                metrics=board, page=lambda now, _expiry: board.body(now), check=board.check)


FEATURE = Feature("protection", build,
                  PageSection(40, lambda body, _now: protection_section(body)))
