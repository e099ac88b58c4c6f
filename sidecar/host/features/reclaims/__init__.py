"""What each reclaim cost: the ledger (``ledger``), ``GET``/``POST /v1/reclaims`` (``api``),
the releases the daemon saw itself (``releases_seen``); docs/protection.md.
"""

from __future__ import annotations

from typing import Optional

from sidecar.host.features import Feature, Needs, PageSection, Part
from sidecar.host.features.events import EventHistory
from sidecar.host.features.reclaims.api import add_reclaim_routes
from sidecar.host.features.reclaims.ledger import ReclaimLedger
from sidecar.host.features.reclaims.page import reclaims_section
from sidecar.host.store import Store

__all__ = ["FEATURE", "ReclaimLedger"]


def served_deadline(store: Store, now: float) -> Optional[tuple[str, float]]:
    """The deadline the daemon's own sources serve now (a drill's never is): the releases
    the daemon sees come from it alone (``releases_seen``)."""
    expiry = store.expiry(now)
    if expiry.expires_at_unix is None or expiry.source is None:
        return None
    return expiry.source, expiry.expires_at_unix


def build(needs: Needs) -> Part:
    ledger = ReclaimLedger(needs.owner("events", EventHistory),
                           uploads=needs.uploads is not None, on_change=needs.on_change,
                           clock=needs.clock,
                           deadline=lambda now: served_deadline(needs.store, now))
    return Part(owner=ledger, routes=lambda app: add_reclaim_routes(app, ledger, needs.clock),
                metrics=ledger, page=lambda _now, _expiry: ledger.body(), state=ledger,
                check=ledger.check)


FEATURE = Feature("reclaims", build,
                  PageSection(100, lambda body, _now: reclaims_section(body)))
