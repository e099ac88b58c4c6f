"""The protection board's verdicts at a given instant (sidecar.host.features.protection):
a source whose last good poll is older than its staleness bound while it fails is not
working, and the board judges at the instant it is asked about, not its own clock's.
Found by the mutation check (docs/mutation.md)."""

from __future__ import annotations

from sidecar.host.features.events.history import EventHistory, JobEvent
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


def test_a_short_notice_names_the_work_since_the_jobs_newest_save() -> None:
    """Without an uploader the job's newest save is its durable checkpoint: a notice too
    short for step + save loses the time since that save's step, and says so."""
    store = Store(["gcp"], stale_after=STALE_AFTER, clock=lambda: T0)
    store.record_success("gcp", Observation(None, kind="none"), at=T0 + 290.0)
    history = EventHistory(clock=lambda: T0)
    history.add([JobEvent(kind="step-estimate", job="j:1", at_unix=T0, step_seconds=10.0,
                          save_seconds=60.0),
                 JobEvent(kind="save-finished", job="j:1", at_unix=T0, step=7, seconds=60.0)],
                now=T0)
    board = ProtectionBoard(store, {"gcp": 30.0}, events=history,
                            clock=lambda: T0 + 10_000_000.0)
    verdict = board.verdicts(T0 + 300.0)[0]
    assert (verdict.protected, verdict.at_risk_seconds, verdict.at_risk_step) == (
        False, 300.0, 7)
    assert verdict.reason == ("gcp: 30 s notice < 70 s step + save: a reclaim now loses "
                              "the 300 s since step 7")
