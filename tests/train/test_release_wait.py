"""After the final save the job waits for the release instead of leaving at once: a renewal
(the release moved later) resumes training in the same process and the rule re-arms; a
release that comes ends the loop with ``released`` set. The README's loop, run in a thread
on real time, against the real daemon polling the Volcengine emulator over the real SDK.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from daemon_harness import serve_daemon, wait_for

from sidecar.timeparse import parse_timestamp
from sidecar.tools.emulator import Emulator
from sidecar.train.client import SidecarClient
from sidecar.train.guard import EXIT_RELEASED, CheckpointGuard
from sidecar.train.policy import SavePolicy

ACCESS_KEY = "AKLTwaittest000001"
SECRET_KEY = "d2FpdC1mb3ItdGhlLXJlbGVhc2U="
STEP_SECONDS = 0.2


@pytest.fixture
def emulator(monkeypatch: pytest.MonkeyPatch) -> Iterator[Emulator]:
    monkeypatch.setenv("VOLCENGINE_ACCESS_KEY", ACCESS_KEY)
    monkeypatch.setenv("VOLCENGINE_SECRET_KEY", SECRET_KEY)
    monkeypatch.delenv("VOLCENGINE_SESSION_TOKEN", raising=False)
    with Emulator(access_key=ACCESS_KEY, secret_key=SECRET_KEY, region="cn-beijing",
                  instance_id="i-wait0001", scheduled_instance_id="esi-wait0001",
                  auto_release_at=None) as emu:
        emu.set_release_in(3600)
        yield emu


@contextmanager
def guarded(emulator: Emulator, **options: Any) -> Iterator[CheckpointGuard]:
    """The real daemon polling the emulator, and a guard asking it every 0.1 s with a rule
    scaled down to seconds (0.5 s save, 1.5 s margin)."""
    with serve_daemon(sources=("volcengine-esi",), api_endpoint=emulator.url,
                      metadata_url=emulator.url, poll_interval=0.2) as daemon:
        wait_for(lambda: daemon.store.health().ok)
        yield CheckpointGuard(SidecarClient(daemon.url),
                              SavePolicy(save_seconds=0.5, redundant_seconds=1.5),
                              refresh_seconds=0.1, environ={}, **options)


class Loop:
    """The README's ten lines, in a thread, recording what happened."""

    def __init__(self, guard: CheckpointGuard) -> None:
        self.guard = guard
        self.steps: list[tuple[int, float]] = []  # (step, wall time at its end)
        self.saves: list[tuple[int, float]] = []
        self.stopped_at: float | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            for step in range(100_000):
                with self.guard.step():
                    time.sleep(STEP_SECONDS)
                self.steps.append((step, time.time()))
                if self.guard.should_save():
                    with self.guard.saving(step):
                        self.saves.append((step, time.time()))
                if self.guard.should_stop():
                    self.stopped_at = time.time()
                    return
        except BaseException as exc:  # reported to the test
            self.error = exc


def test_a_renewal_after_the_final_save_resumes_training_in_the_same_process(
    emulator: Emulator, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="sidecar.train.guard")
    first = parse_timestamp(emulator.set_release_in(5)).unix
    with guarded(emulator) as guard:
        loop = Loop(guard)
        loop.thread.start()
        wait_for(lambda: loop.saves or loop.error, timeout=15)
        assert loop.error is None
        saved_step = loop.saves[0][0]
        time.sleep(3 * STEP_SECONDS)
        # Saved, and no further step could be saved in time: the loop waits in should_stop.
        assert [step for step, _ in loop.steps][-1] == saved_step and loop.stopped_at is None
        second = parse_timestamp(emulator.set_release_in(6)).unix  # renewed: 6 s from now
        assert second > first
        wait_for(lambda: loop.steps[-1][0] > saved_step or loop.error, timeout=10)
        assert loop.error is None and loop.stopped_at is None  # training goes on
        loop.thread.join(20)
        assert not loop.thread.is_alive() and loop.error is None
    # Once per deadline: the renewal re-armed the rule, a second final save was made for
    # the new release, and the loop left only once that release had come.
    assert len(loop.saves) == 2 and loop.saves[1][0] > saved_step
    assert loop.stopped_at is not None and loop.stopped_at >= second - 0.05
    assert guard.released is True
    lines = [r.getMessage() for r in caplog.records]
    assert any("the release moved later" in line for line in lines)
    assert any(f"exit status {EXIT_RELEASED}" in line for line in lines)


def test_without_a_renewal_the_loop_leaves_when_the_release_comes(emulator: Emulator) -> None:
    release = parse_timestamp(emulator.set_release_in(4)).unix
    with guarded(emulator) as guard:
        loop = Loop(guard)
        loop.thread.start()
        loop.thread.join(15)
    assert loop.error is None and len(loop.saves) == 1
    saved_step = loop.saves[0][0]
    assert loop.steps[-1][0] == saved_step  # no step trained into the void after the save
    assert loop.stopped_at is not None and release - 0.05 <= loop.stopped_at < release + 1.0
    assert guard.released is True


def test_the_wait_can_be_turned_off(emulator: Emulator) -> None:
    emulator.set_release_in(4)
    with guarded(emulator, wait_for_release=False) as guard:
        loop = Loop(guard)
        loop.thread.start()
        loop.thread.join(15)
    assert loop.error is None and len(loop.saves) == 1
    assert loop.stopped_at is not None and loop.stopped_at - loop.saves[0][1] < 1.0
    assert guard.released is False


def test_a_sleep_that_raises_is_the_callers(emulator: Emulator) -> None:
    """KeyboardInterrupt (Ctrl-C) during the wait reaches the training script."""
    emulator.set_release_in(4)
    calls: list[Any] = []

    def interrupted(seconds: float) -> None:
        calls.append(seconds)
        raise KeyboardInterrupt

    with guarded(emulator, sleep=interrupted) as guard:
        loop = Loop(guard)
        loop.thread.start()
        loop.thread.join(15)
    assert isinstance(loop.error, KeyboardInterrupt) and len(calls) == 1


@pytest.mark.parametrize("passed_seconds", [2, 100])
def test_a_release_that_jumps_into_the_past_gets_a_best_effort_save_and_a_stop(
    emulator: Emulator, passed_seconds: int, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 22, item 2: a deadline learned only once it had passed (40 s away, then 2 s
    or 100 s in the past) used to give no save and no stop: the loop trained on
    unprotected until the machine died."""
    caplog.set_level(logging.INFO, logger="sidecar.train.guard")
    emulator.set_release_in(40)
    with guarded(emulator) as guard:
        loop = Loop(guard)
        loop.thread.start()
        wait_for(lambda: len(loop.steps) >= 3 or loop.error, timeout=15)
        assert not loop.saves  # 40 s away: outside the window
        emulator.set_release_in(-passed_seconds)
        loop.thread.join(15)
    assert loop.error is None and not loop.thread.is_alive()
    assert len(loop.saves) == 1  # one best-effort save, then the stop
    assert loop.steps[-1][0] == loop.saves[0][0]  # nothing trained after it
    assert guard.released is True
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("best-effort save now" in line for line in warnings)
