"""Routine saves where no notice can hold a save: the Young/Daly figures, the plan and its
line, when they are due, and the guard asking them against the real daemon (issue 23,
item 6)."""

from __future__ import annotations

import logging
import math
import time

import pytest
from guard_support import FakeMonotonic, closed_port, simple_guard, static_daemon

from sidecar.train.client import SidecarClient
from sidecar.train.policy import SavePolicy
from sidecar.train.protection import DurableCheckpoint, JobFigures
from sidecar.train.routine import (
    FALLBACK_RECLAIM_EVERY_SECONDS,
    FLOOR_SECONDS,
    RoutineSaves,
    check_routine,
    measured_reclaim_every,
    plan_routine,
    reclaim_every,
    routine_floor_seconds,
    young_daly_seconds,
)

HOUR = 3600.0
HEAVY = JobFigures(step_seconds=5.0, save_seconds=35.0, upload_seconds=60.0)  # 100 s

# ------------------------------------------------------------------ the numbers


def test_the_young_daly_interval_is_the_square_root_of_twice_save_times_reclaims() -> None:
    # The example: a 95 s save, a reclaim every 3 h: routine saves every 24 min.
    assert young_daly_seconds(95.0, 3 * HOUR) == pytest.approx(math.sqrt(2 * 95 * 10800))
    assert round(young_daly_seconds(95.0, 3 * HOUR) / 60) == 24
    assert young_daly_seconds(35.0, 6 * HOUR) == pytest.approx(1229.6, abs=0.1)
    # Never shorter than the save itself (a reclaim more often than the save: save back
    # to back rather than never).
    assert young_daly_seconds(100.0, 10.0) == 100.0


def test_reclaim_rates_of_several_sources_add_and_an_unknown_source_gets_the_fallback() -> None:
    assert reclaim_every(["gcp"]) == 6 * HOUR
    assert reclaim_every(["gcp", "aws"]) == pytest.approx(3 * HOUR)
    assert reclaim_every(["someone-elses"]) == FALLBACK_RECLAIM_EVERY_SECONDS
    assert reclaim_every([]) == FALLBACK_RECLAIM_EVERY_SECONDS


def test_the_measured_mean_counts_the_default_as_one_more_life() -> None:
    assert measured_reclaim_every([], 6 * HOUR) is None
    assert measured_reclaim_every([2 * HOUR, 4 * HOUR], 6 * HOUR) == pytest.approx(4 * HOUR)
    # Nonsense lives (a clock step, an open account) are left out.
    assert measured_reclaim_every([-5.0, math.nan, 1 * HOUR], 5 * HOUR) == pytest.approx(
        3 * HOUR)


def test_the_setting_is_auto_seconds_or_none() -> None:
    assert check_routine("auto") == "auto"
    assert check_routine(None) is None
    assert check_routine(600) == 600.0
    for bad in ("sometimes", 0, -1.0, math.inf, True):
        with pytest.raises(ValueError, match="routine_seconds"):
            check_routine(bad)
    with pytest.raises(ValueError, match="routine_seconds"):
        SavePolicy(routine_seconds="often")
    assert SavePolicy().routine_seconds == "auto"  # the default: engages only when needed


# ------------------------------------------------------------------ the plan


def test_a_30_s_notice_with_a_100_s_save_and_upload_gets_routine_saves_and_says_the_cost() -> None:
    plan = plan_routine("auto", {"gcp": 30.0, "volcengine-esi": None}, HEAVY,
                        durable=DurableCheckpoint(120, 1000.0), now=1000.0 + 14 * 60)
    assert plan.engaged and [v.source for v in plan.exposed] == ["gcp"]
    assert plan.interval_seconds == pytest.approx(math.sqrt(2 * 35 * 6 * HOUR))
    assert plan.line == (
        "a GCP preemption gives 30 s; a step + save + upload takes 100 s; a reclaim loses "
        "up to 22 min (now 14 min, since step 120), routine saves every 20 min (Young/Daly: "
        "a 35 s save, a reclaim every 6.0 h assumed)")


def test_a_notice_that_holds_the_save_gets_no_routine_saves() -> None:
    plan = plan_routine("auto", {"aws": 120.0, "volcengine-esi": None}, HEAVY)
    assert not plan.engaged
    assert plan.line.startswith("no routine saves: aws: 120 s notice >= 100 s")
    assert not plan_routine("auto", {}, HEAVY).engaged  # no source with a notice
    assert not plan_routine(None, {"gcp": 30.0}, HEAVY).engaged  # off, as before
    # No save time known yet: nothing to hold against the notice.
    assert not plan_routine("auto", {"gcp": 30.0}, JobFigures(5.0, None, None)).engaged


def test_the_automatic_interval_has_a_floor_of_ten_saves_and_five_minutes() -> None:
    assert routine_floor_seconds(0.01) == FLOOR_SECONDS == 300.0
    assert routine_floor_seconds(60.0) == 600.0
    # A save measured at about 0 s: Young/Daly says every 9 s (a save every few steps).
    tiny = JobFigures(step_seconds=1.0, save_seconds=0.002, upload_seconds=60.0)
    assert young_daly_seconds(0.002, 6 * HOUR) < 10.0
    plan = plan_routine("auto", {"gcp": 30.0}, tiny)
    assert plan.interval_seconds == 300.0
    assert plan.line.endswith("routine saves every 300 s (Young/Daly: a 0 s save, a "
                              "reclaim every 6.0 h assumed; the floor: 10 x the save, at "
                              "least 300 s)")
    # Many reclaims measured: the optimum falls under ten saves, the floor holds.
    plan = plan_routine("auto", {"gcp": 30.0}, HEAVY, machine_seconds=[600.0] * 50)
    assert young_daly_seconds(35.0, plan.reclaim_every_seconds or 0) < 350.0
    assert plan.interval_seconds == 350.0
    # Where the optimum is above it, the floor changes nothing; a number is kept as given.
    assert plan_routine("auto", {"gcp": 30.0}, HEAVY).interval_seconds == pytest.approx(
        young_daly_seconds(35.0, 6 * HOUR))
    assert plan_routine(60.0, {"gcp": 30.0}, tiny).interval_seconds == 60.0


def test_a_number_saves_at_that_interval_whatever_the_notices() -> None:
    plan = plan_routine(900.0, {"aws": 120.0}, HEAVY)
    assert plan.interval_seconds == 900.0
    assert "routine saves every 15 min (routine_seconds)" in plan.line


def test_measured_reclaims_replace_the_default_and_the_line_says_so() -> None:
    plan = plan_routine("auto", {"gcp": 30.0}, HEAVY, machine_seconds=[HOUR, HOUR])
    assert plan.reclaim_every_seconds == pytest.approx((6 * HOUR + 2 * HOUR) / 3)
    assert plan.interval_seconds == pytest.approx(math.sqrt(2 * 35 * 9600))
    assert "a reclaim every 2.7 h measured over 2 releases" in plan.line


# ------------------------------------------------------------------ when they are due


def test_routine_saves_come_due_one_interval_after_the_last_save_and_ask_once_a_minute(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "test.routine")
    monotonic = FakeMonotonic()
    asked: list[str] = []

    def notices() -> dict[str, float]:
        asked.append("notices")
        return {"gcp": 30.0}

    routine = RoutineSaves("auto", logging.getLogger("test.routine"), monotonic=monotonic,
                           notices=notices, machine_lives=lambda: asked.append("lives") or [])
    interval = math.sqrt(2 * 35 * 6 * HOUR)
    start = 1_900_000_000.0
    overdue = routine.overdue(start, HEAVY)
    assert overdue == pytest.approx(-interval)
    for _ in range(3):  # every step: no new question within the minute
        routine.overdue(start + 1, HEAVY)
    assert asked == ["notices"]
    monotonic.advance(61)
    assert routine.overdue(start + interval + 1, HEAVY) == pytest.approx(1.0)
    assert asked == ["notices", "notices", "lives"]  # engaged: the reclaims are asked too
    routine.saved(start + interval + 1)  # any save restarts the interval
    assert routine.overdue(start + interval + 2, HEAVY) == pytest.approx(1 - interval)
    lines = [r for r in caplog.records if r.name == "test.routine"]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING  # said once
    assert lines[0].getMessage().startswith("a GCP preemption gives 30 s;")


def test_no_routine_saves_when_off_and_nothing_is_asked() -> None:
    asked: list[int] = []
    routine = RoutineSaves(None, logging.getLogger("test.routine"), monotonic=FakeMonotonic(),
                           notices=lambda: asked.append(1) or {"gcp": 30.0})
    assert routine.overdue(1000.0, HEAVY) is None and asked == []


def test_a_daemon_that_fails_the_question_is_no_error() -> None:
    def broken() -> dict[str, float]:
        raise RuntimeError("boom")

    routine = RoutineSaves("auto", logging.getLogger("test.routine"), monotonic=FakeMonotonic(),
                           notices=broken)
    assert routine.overdue(1000.0, HEAVY) is None


# ------------------------------------------------------------------ the guard


def test_the_client_reads_each_running_sources_notice_from_the_daemon() -> None:
    with static_daemon(time.time() + 10 * HOUR, notices={"static": 30.0}) as daemon:
        client = SidecarClient(daemon.url)
        assert client.source_notices() == {"static": 30.0}
        assert client.machine_lives() == []
    dead = SidecarClient(f"http://127.0.0.1:{closed_port()}")
    assert dead.source_notices() is None and dead.last_error is None


def routine_guard(url: str, start: float, **options: object):  # type: ignore[no-untyped-def]
    now = [start]
    guard = simple_guard(SidecarClient(url), policy=SavePolicy(**options),  # type: ignore[arg-type]
                         clock=lambda: now[0], refresh_seconds=0.0, events=False)
    return guard, now


def test_the_guard_asks_a_routine_save_that_never_disarms_the_final_save(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "sidecar.train.guard")
    start = time.time()
    deadline = start + 10 * HOUR  # far: the rule itself saves only near it
    with static_daemon(deadline, notices={"static": 30.0}) as daemon:
        guard, now = routine_guard(daemon.url, start)
        guard.record_step(5.0)
        guard.record_save(35.0 / 1.2, started_unix=start)  # measured: 35 s with the x1.2
        interval = math.sqrt(2 * 35.0 * 6 * HOUR)
        now[0] = start + interval - 5
        assert guard.should_save() is False
        status = guard.status()
        assert status.routine_seconds == pytest.approx(interval)
        assert status.routine_note is not None and status.routine_note.startswith(
            "a static notice gives 30 s; a step + save takes 40 s; a reclaim loses up to 21 min")
        now[0] = start + interval + 1
        assert guard.should_save() is True
        decision = guard.last_decision
        assert decision is not None and decision.routine and not decision.stop
        with guard.saving(step=100):
            now[0] += 35.0
        assert guard.status().final_step is None  # not followed as the final save
        guard.record_step(5.0)
        now[0] += 5.0
        assert guard.should_save() is False  # the interval restarted at that save
        # The release comes near: the final save is asked, the routine save covered nothing.
        now[0] = deadline - 150.0
        assert guard.should_save() is True
        decision = guard.last_decision
        assert decision is not None and not decision.routine
        with guard.saving(step=200):
            now[0] += 35.0
        assert guard.status().final_step == 200
    said = [r.getMessage() for r in caplog.records if "routine saves every" in r.getMessage()]
    assert len(said) == 1, said


def test_without_routine_saves_the_guard_saves_only_for_the_deadline_as_before() -> None:
    start = time.time()
    with static_daemon(start + 10 * HOUR, notices={"static": 30.0}) as daemon:
        guard, now = routine_guard(daemon.url, start, routine_seconds=None)
        guard.record_step(5.0)
        guard.record_save(35.0, started_unix=start)
        now[0] = start + 5 * HOUR
        assert guard.should_save() is False
        assert guard.status().routine_seconds is None


def test_a_notice_that_holds_the_save_costs_no_routine_save() -> None:
    start = time.time()
    with static_daemon(start + 10 * HOUR, notices={"static": 300.0}) as daemon:
        guard, now = routine_guard(daemon.url, start)
        guard.record_step(5.0)
        guard.record_save(35.0, started_unix=start)
        now[0] = start + 5 * HOUR
        assert guard.should_save() is False


def test_a_sigterm_grace_shorter_than_the_save_is_a_short_notice_too() -> None:
    import signal

    start = time.time()
    now = [start]
    guard = simple_guard(SidecarClient(f"http://127.0.0.1:{closed_port()}"),
                         policy=SavePolicy(), clock=lambda: now[0], events=False,
                         sigterm_grace_seconds=20)
    try:
        guard.record_step(5.0)
        guard.record_save(50.0, started_unix=start)  # 60 s with the x1.2 > 20 s grace
        now[0] = start + math.sqrt(2 * 60.0 * 6 * HOUR) + 1
        assert guard.should_save() is True
        assert guard.last_decision is not None and guard.last_decision.routine
    finally:
        if guard.sigterm is not None:
            guard.sigterm.uninstall()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
