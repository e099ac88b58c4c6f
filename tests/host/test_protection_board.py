"""The protection board's verdicts at a given instant (sidecar.host.features.protection):
a source whose last good poll is older than its staleness bound while it fails is not
working, and the board judges at the instant it is asked about, not its own clock's.
Found by the mutation check (docs/mutation.md)."""

from __future__ import annotations

from sidecar.host.features.protection.board import ProtectionBoard
from sidecar.host.store import Store
from sidecar.models import Observation

T0 = 1_800_000_000.0
STALE_AFTER = 60.0


def board_of(store: Store) -> ProtectionBoard:
    # Its own clock is far in the future: every answer below is for the instant asked.
    return ProtectionBoard(store, {"static": None}, clock=lambda: T0 + 10_000_000.0)


def test_a_source_failing_past_its_staleness_bound_is_not_working_at_that_instant() -> None:
    store = Store(["static"], stale_after=STALE_AFTER, clock=lambda: T0)
    store.record_success("static", Observation(T0 + 7200.0, kind="release"), at=T0)
    store.record_failure("static", "HTTP 503 from the metadata service", at=T0 + 30.0)
    board = board_of(store)
    # 30 s after the last good poll the failure is a retry: the source still works.
    fresh = board.verdicts(T0 + 30.0)[0]
    assert fresh.working and fresh.status == "protected", fresh
    # 90 s after it, past the 60 s bound: not working, and the line says why.
    stale = board.verdicts(T0 + 90.0)[0]
    assert (stale.status, stale.protected, stale.working) == ("not-working", None, False)
    assert stale.reason == ("static: not working (no successful poll for 90 s: HTTP 503 from "
                            "the metadata service): a deadline it would give is not seen")
