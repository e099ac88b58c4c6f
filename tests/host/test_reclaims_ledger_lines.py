"""What the reclaim ledger says and refuses, word for word (sidecar.host.features.reclaims):
the line per account, its level, the rate limit's refusal and its line, and which accounts
count as one. Found by the mutation check (docs/mutation.md): the ledger's rule was tested,
its words and its edges were not, and an operator reads the words.
"""

from __future__ import annotations

import logging

import pytest

from sidecar.host.features.reclaims.ledger import (
    ACCOUNTS_BURST,
    LOG_EVERY_SECONDS,
    AccountRefused,
    ReclaimLedger,
)
from sidecar.train.reclaim_cost import ReleaseCost

RELEASED = 1_700_003_000.0
LOGGER = "sidecar.host.reclaims"


class Clocks:
    """The ledger's wall clock and monotonic clock, moved by the test."""

    def __init__(self) -> None:
        self.wall = 1_700_000_000.0
        self.mono = 1000.0

    def ledger(self) -> ReclaimLedger:
        ledger = ReclaimLedger(clock=lambda: self.wall, monotonic=lambda: self.mono)
        self.wall += 7200.0  # the daemon has run two hours
        return ledger

    def later(self) -> None:
        self.mono += LOG_EVERY_SECONDS  # the next line about accounts may be logged


def cost(lost: float, *, released: float = RELEASED, job: str = "j:1",
         step: int | None = 7) -> ReleaseCost:
    return ReleaseCost(released_unix=released, state_unix=released - lost, resumed_step=step,
                       lost_seconds=lost, redone_seconds=lost / 4, idle_seconds=lost / 8,
                       saves=2, job=job)


def lines(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    found = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == LOGGER]
    caplog.clear()
    return found


def test_each_account_is_one_line_a_warning_only_beyond_ten_minutes(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    clocks = Clocks()
    ledger = clocks.ledger()
    assert ledger.record(cost(600.0, job="a:1"))
    assert lines(caplog) == [(logging.INFO, (
        "a:1: the release cost 10 min of GPU time from step 7 (150 s redone, 75 s idle, "
        "2 saves; posted by job events)"))]
    clocks.later()
    assert ledger.record(cost(601.0, job="b:1", step=None), posted_by="restore from 10.0.0.2")
    assert lines(caplog) == [(logging.WARNING, (
        "b:1: the release cost 10 min of GPU time from a checkpoint that names no step "
        "(150 s redone, 75 s idle, 2 saves; posted by restore from 10.0.0.2)"))]


def test_over_the_burst_an_account_is_refused_with_429_and_said_once_a_minute(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    clocks = Clocks()
    ledger = clocks.ledger()
    assert ledger.record(cost(60.0, released=RELEASED - 1))  # a line at t = 0
    assert len(lines(caplog)) == 1
    # 59 s later a sender spends its whole burst: counted, not logged (one line a minute).
    clocks.mono += LOG_EVERY_SECONDS - 1
    sender = "restore from 10.0.0.9"
    for n in range(ACCOUNTS_BURST):
        assert ledger.record(cost(60.0, released=RELEASED + n), posted_by=sender)
    assert lines(caplog) == []
    # A second on, the next line may be logged, and the sender's bucket holds 1/60 of an
    # account: refused, and said.
    clocks.mono += 1
    with pytest.raises(AccountRefused) as refused:
        ledger.record(cost(60.0, released=RELEASED + 100), posted_by=sender)
    assert refused.value.status == 429
    assert str(refused.value) == (f"accounts: more than {ACCOUNTS_BURST} at once, then one a "
                                  "minute from one sender; try later")
    assert lines(caplog) == [(logging.WARNING, (
        f"refused an account from {sender}: over {ACCOUNTS_BURST} at once, then one a minute"
        f" (and {ACCOUNTS_BURST} more about accounts since the last line: GET /v1/reclaims)"))]
    assert ledger.body()["refused"] == {"implausible": 0, "rate": 1}
    with pytest.raises(AccountRefused):  # every refusal counted, not only the first
        ledger.record(cost(60.0, released=RELEASED + 101), posted_by=sender)
    assert ledger.body()["refused"] == {"implausible": 0, "rate": 2}
    # Another sender has an allowance of its own.
    assert ledger.record(cost(60.0, released=RELEASED + 200), posted_by="job events")


def test_one_account_per_job_and_release_to_the_millisecond() -> None:
    ledger = Clocks().ledger()
    assert ledger.record(cost(60.0, released=RELEASED + 0.1))
    # The same release read again, rounded differently below the millisecond: one account.
    assert not ledger.record(cost(60.0, released=RELEASED + 0.1004))
    # Two milliseconds apart: two releases (two machines of one job).
    assert ledger.record(cost(60.0, released=RELEASED + 0.102))
    # Another job, the same instant: its own account.
    assert ledger.record(cost(60.0, released=RELEASED + 0.1, job="other:1"))
    assert ledger.body()["count"] == 3


def test_an_implausible_account_is_refused_with_422_and_one_line_naming_the_figure(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    ledger = Clocks().ledger()  # two hours up: the bound is 7200 s + a day = 93600 s
    with pytest.raises(AccountRefused) as refused:
        ledger.record(cost(93_601.0), posted_by="restore from 10.0.0.3")
    assert refused.value.status == 422
    assert str(refused.value) == (
        "lost_seconds: 93601 s (released_unix - state_unix for lost_seconds) is more than "
        "this daemon has run plus a day (93600 s)")
    assert lines(caplog) == [(logging.WARNING, (
        "refused an account from restore from 10.0.0.3: lost_seconds 93601 s is more than "
        "this daemon ran plus a day"))]
    assert ledger.body()["refused"] == {"implausible": 1, "rate": 0}
