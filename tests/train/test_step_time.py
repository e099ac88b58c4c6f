"""What ``guard.step()`` records: the pass of the loop between decisions, not the span.

Driven on hand-moved clocks (wall and monotonic move together), with the deadline in the
environment: the loop loads its batch outside the timed span, as real loops do.
"""

from __future__ import annotations

import json
from typing import Optional

import pytest
from guard_support import (  # noqa: F401  (clean_environment: a fixture)
    MLP,
    FakeMonotonic,
    clean_environment,
    closed_port,
    good_body,
    simple_guard,
)

from sidecar.models import Expiry
from sidecar.train.client import SidecarClient
from sidecar.train.guard import CheckpointGuard
from sidecar.train.policy import SavePolicy

OUTSIDE, INSIDE = 0.049, 0.001  # data loading outside the span, the step inside it


class Clocks:
    def __init__(self) -> None:
        self.monotonic = FakeMonotonic()
        self.wall = 1_900_000_000.0

    def clock(self) -> float:
        return self.wall

    def elapse(self, seconds: float) -> None:
        self.wall += seconds
        self.monotonic.advance(seconds)


def guard_on(clocks: Clocks, deadline_unix: float, **options: object) -> CheckpointGuard:
    return simple_guard(
        SidecarClient(f"http://127.0.0.1:{closed_port()}"),
        policy=SavePolicy(save_seconds=0.5, redundant_seconds=2.0, top_up_seconds=0.5),
        environ={MLP: repr(deadline_unix)}, clock=clocks.clock, monotonic=clocks.monotonic,
        **options,
    )


def one_pass(guard: CheckpointGuard, clocks: Clocks, outside: float = OUTSIDE) -> None:
    clocks.elapse(outside)  # the batch, loaded before the step
    with guard.step():
        clocks.elapse(INSIDE)


@pytest.mark.parametrize("offset", [0.0, 0.013, 0.031, 0.047])
def test_work_outside_the_span_still_gets_its_top_up_save(offset: float) -> None:
    """Timing the span alone (1 ms of a 50 ms pass), the crossing decision found less
    than a save and its margin left, and stopped without the top-up."""
    clocks = Clocks()
    guard = guard_on(clocks, clocks.wall + 30.0 + offset)
    saves: list[int] = []
    for step in range(10_000):
        one_pass(guard, clocks)
        if guard.should_save():
            with guard.saving(step):
                clocks.elapse(0.01)
                saves.append(step)
        if guard.should_stop():
            break
    assert len(saves) == 2, saves  # the final save, then the top-up
    status = guard.status()
    assert status.top_up_step == saves[1]
    assert status.step_seconds == pytest.approx(OUTSIDE + INSIDE)
    left = status.remaining_seconds
    assert left is not None and 0 < left < 0.6  # the top-up came late: little thrown away


def test_the_window_holds_passes_and_the_rule_budgets_the_slowest() -> None:
    clocks = Clocks()
    guard = guard_on(clocks, clocks.wall + 3600.0)
    with guard.step():  # the first step: its own span, nothing before it to time
        clocks.elapse(INSIDE)
    assert guard.policy.step_estimate() == pytest.approx(INSIDE)
    for _ in range(5):
        one_pass(guard, clocks)
        guard.should_save()
    one_pass(guard, clocks, outside=0.299)  # an evaluation between two steps
    guard.should_save()
    one_pass(guard, clocks)
    assert guard.policy.step_estimate() == pytest.approx(0.3)  # T_max_step: the max
    assert guard.policy.typical_step_estimate() == pytest.approx(OUTSIDE + INSIDE)
    assert guard.status().budget_seconds == pytest.approx(0.3 + 0.5 + 2.0)


def test_a_save_between_two_steps_is_not_a_step() -> None:
    clocks = Clocks()
    guard = guard_on(clocks, clocks.wall + 3600.0)
    one_pass(guard, clocks)
    with guard.saving():
        clocks.elapse(10.0)
    one_pass(guard, clocks)
    guard.record_save(5.0)  # timed by the caller, e.g. an asynchronous save's blocking part
    clocks.elapse(5.0)
    one_pass(guard, clocks)
    assert guard.policy.step_estimate() == pytest.approx(OUTSIDE + INSIDE)


class MovableDeadline(SidecarClient):
    """A daemon's answer without a daemon: the test moves the deadline."""

    def __init__(self, clocks: Clocks, deadline_unix: float) -> None:
        super().__init__(f"http://127.0.0.1:{closed_port()}")
        self.clocks, self.deadline_unix = clocks, deadline_unix

    def expiry(self) -> Optional[Expiry]:
        now = self.clocks.wall
        body = good_body(expires_at_unix=self.deadline_unix, server_time_unix=now,
                         remaining_seconds=self.deadline_unix - now)
        return Expiry.from_json(json.loads(body))


def test_the_wait_for_the_release_is_not_a_step() -> None:
    clocks = Clocks()
    client = MovableDeadline(clocks, clocks.wall + 2.0)

    def sleep(seconds: float) -> None:  # a second of waiting for the release, a renewal
        clocks.elapse(seconds)
        client.deadline_unix = clocks.wall + 3600.0

    guard = CheckpointGuard(client, SavePolicy(save_seconds=0.5, redundant_seconds=2.0,
                                               top_up_seconds=None),
                            environ={}, clock=clocks.clock, monotonic=clocks.monotonic,
                            sleep=sleep, events=False)
    one_pass(guard, clocks)
    assert guard.should_save()
    with guard.saving():
        clocks.elapse(0.01)
    waited_from = clocks.wall
    assert guard.should_stop() is False  # waited, then the release moved later
    assert clocks.wall - waited_from == pytest.approx(1.0)  # one refresh interval
    one_pass(guard, clocks)
    assert guard.policy.step_estimate() == pytest.approx(OUTSIDE + INSIDE)
