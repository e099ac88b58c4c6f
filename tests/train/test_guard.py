"""CheckpointGuard, the training loop's guard, against the real daemon on loopback: the
save and stop decisions, the deadline's fallbacks, the ranks' vote, its state in the
checkpoint. The wait for the release: test_release_wait.py; durability: test_durability.py.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Callable, Optional

import pytest
from daemon_harness import serve_daemon, wait_for
from guard_support import (  # noqa: F401  (clean_environment: a fixture)
    MLP,
    SAGEMAKER,
    TRAIN_LOGGER,
    CountingClient,
    FakeMonotonic,
    ThreadAllReduce,
    clean_environment,
    closed_port,
    good_body,
    simple_guard,
    static_daemon,
)

from sidecar.models import KIND_PREEMPTION, Expiry, Observation
from sidecar.train.client import SidecarClient
from sidecar.train.deadline import DeadlineTracker
from sidecar.train.guard import (
    UNKNOWN_AFTER_FINAL,
    UNKNOWN_COVERED,
    UNKNOWN_REMAINING,
    UNKNOWN_SAVE,
    UNKNOWN_STEP,
    UNKNOWN_UPLOAD,
    CheckpointGuard,
)
from sidecar.train.policy import SavePolicy
from sidecar.train.vote import UNKNOWN_PROCESS, UNKNOWN_ROUTINE, Op

# ------------------------------------------------------------------ guard: real daemon


def test_guard_saves_once_then_stops_against_the_real_daemon() -> None:
    with static_daemon(time.time() + 200) as daemon:
        # 100 s save + 120 s margin > 200 s left: the first decision is "save now".
        guard = simple_guard(SidecarClient(daemon.url),
                             policy=SavePolicy(save_seconds=100.0, top_up_seconds=None))
        assert guard.should_save() is False  # no step measured yet
        assert guard.last_decision is not None
        assert guard.last_decision.reason == "no step measured yet"
        saves: list[float] = []
        steps_run = 0
        for _ in range(5):
            with guard.step():
                steps_run += 1
            if guard.maybe_save(lambda: saves.append(time.time())):
                assert guard.should_save() is False
            if guard.should_stop():
                break
        assert len(saves) == 1
        assert steps_run == 1
        status = guard.status()
        assert status.stop and not status.save_now
        assert status.deadline_source == "daemon" and status.daemon_reachable
        assert status.remaining_seconds is not None and 190 < status.remaining_seconds < 200.5
        assert status.save_seconds < 1.0  # measured: the lambda took microseconds


def test_guard_outside_the_window_does_not_save() -> None:
    with static_daemon(time.time() + 3600) as daemon:
        guard = simple_guard(SidecarClient(daemon.url))
        for _ in range(3):
            with guard.step():
                pass
            assert guard.should_save() is False
            assert guard.should_stop() is False
        status = guard.status()
        assert status.budget_seconds is not None and 180 <= status.budget_seconds < 181
        assert status.reason.startswith("remaining ")


@contextmanager
def _final_save_made(now: float, wall: list[float], monotonic: FakeMonotonic
                     ) -> Iterator[tuple[Any, CheckpointGuard]]:
    """A daemon serving a deadline ``now + 200`` and a guard (clocks ``wall[0]`` and
    ``monotonic``) that made its final save for it and stops: covered until about
    now + 221 s (+ 120 s to re-arm). The daemon's poll_interval is long so that the test,
    not the poller, sets what the store serves."""
    with static_daemon(now + 200, poll_interval=3600) as daemon:
        guard = simple_guard(
            SidecarClient(daemon.url),
            policy=SavePolicy(save_seconds=100.0, top_up_seconds=None),
            clock=lambda: wall[0],
            monotonic=monotonic,
        )
        guard.record_step(1.0)
        assert guard.should_save()
        with guard.saving():
            pass
        assert guard.should_stop()
        yield daemon, guard


def test_guard_rearms_when_the_daemon_moves_the_deadline_later() -> None:
    now = time.time()
    wall = [now]
    monotonic = FakeMonotonic()
    with _final_save_made(now, wall, monotonic) as (daemon, guard):
        later = now + 200 + 7200
        daemon.store.record_success("static", Observation(expires_at_unix=later))
        monotonic.advance(1.0)  # the next refresh is due
        assert guard.should_save() is False
        assert guard.should_stop() is False  # armed again: keep training
        assert guard.status().deadline_unix == pytest.approx(later)

        wall[0] = later - 100  # near: 1 s step + ~0 s measured save + 120 s margin
        assert guard.should_save() is True


def test_routine_save_before_a_notice_does_not_disarm_the_final_save() -> None:
    # The simulator's case, through the real daemon: a routine save while no deadline is
    # known, 40 s of training, then a preemption notice 110 s ahead. That deadline is
    # within one budget of the routine save, but the save was not made for it: save
    # again (once), then stop.
    now = time.time()
    wall = [now]
    monotonic = FakeMonotonic()

    def elapse(seconds: float) -> None:
        wall[0] += seconds
        monotonic.advance(seconds)

    # The env source with no variable set: the daemon answers "no deadline" (a real null).
    with serve_daemon(sources=("env",), poll_interval=3600) as daemon:
        client = SidecarClient(daemon.url)
        wait_for(lambda: (client.expiry() or Expiry.from_json({"server_time_unix": 1})).source)
        guard = simple_guard(client, policy=SavePolicy(top_up_seconds=None), clock=lambda: wall[0],
                             monotonic=monotonic)
        guard.record_step(20.0)  # budget 20 + 60 + 120 = 200 s until a save is measured
        assert guard.should_save() is False
        with guard.saving():  # the user's own routine save, timed by the guard
            elapse(10.0)
        assert guard.should_stop() is False
        for _ in range(2):
            guard.record_step(20.0)
            elapse(20.0)
            assert guard.should_save() is False
            assert guard.should_stop() is False

        deadline = now + 160.0  # 110 s ahead; the routine save started 160 s before it
        daemon.store.record_success(
            "env", Observation(expires_at_unix=deadline, kind=KIND_PREEMPTION)
        )
        monotonic.advance(1.0)  # the next refresh is due
        saves: list[float] = []

        def save() -> None:
            saves.append(wall[0])
            elapse(10.0)

        assert guard.maybe_save(save) is True
        assert guard.should_stop() is True
        assert guard.status().deadline_unix == pytest.approx(deadline)
        for _ in range(3):  # once per deadline: never again inside the window
            guard.record_step(20.0)
            elapse(20.0)
            assert guard.should_save() is False
            assert guard.should_stop() is True
        assert saves == [pytest.approx(now + 50.0)]


def test_user_save_error_propagates_and_is_not_counted() -> None:
    with static_daemon(time.time() + 200) as daemon:
        guard = simple_guard(SidecarClient(daemon.url), policy=SavePolicy(save_seconds=100.0))
        guard.record_step(1.0)

        def failing_save() -> None:
            raise OSError("disk full")

        with pytest.raises(OSError, match="disk full"):
            guard.maybe_save(failing_save)
        assert guard.policy.measured_save_estimate() is None
        assert guard.should_save() is True  # still owed
        assert guard.should_stop() is False


def test_failed_step_is_not_recorded() -> None:
    guard = simple_guard(SidecarClient(f"http://127.0.0.1:{closed_port()}"))
    with pytest.raises(RuntimeError), guard.step():
        raise RuntimeError("nan loss")
    assert guard.policy.step_estimate() is None


def test_step_and_save_are_timed_with_the_monotonic_clock() -> None:
    monotonic = FakeMonotonic()
    guard = simple_guard(SidecarClient(f"http://127.0.0.1:{closed_port()}"), monotonic=monotonic)
    with guard.step():
        monotonic.advance(7.5)
    with guard.saving():
        monotonic.advance(10.0)
    assert guard.policy.step_estimate() == 7.5
    assert guard.policy.save_estimate() == pytest.approx(12.0)


def test_guard_refreshes_at_most_every_refresh_seconds() -> None:
    monotonic = FakeMonotonic()
    with static_daemon(time.time() + 3600) as daemon:
        client = CountingClient(daemon.url)
        guard = simple_guard(client, refresh_seconds=1.0, monotonic=monotonic)
        guard.record_step(0.01)
        for _ in range(100):
            guard.should_save()
        assert client.requests == 1
        monotonic.advance(0.999)
        guard.should_save()
        assert client.requests == 1
        monotonic.advance(0.001)
        for _ in range(10):
            guard.should_save()
        assert client.requests == 2


def test_remaining_is_recomputed_from_the_clock_between_refreshes() -> None:
    now = time.time()
    wall = [now]
    with static_daemon(now + 1000) as daemon:
        guard = simple_guard(
            SidecarClient(daemon.url),
            clock=lambda: wall[0],
            monotonic=FakeMonotonic(),  # never advances: no second request
        )
        guard.record_step(10.0)
        assert guard.should_save() is False
        wall[0] = now + 900  # 100 s left <= 10 + 60 + 120
        assert guard.should_save() is True
        assert guard.status().remaining_seconds == pytest.approx(100.0, abs=1e-3)


# ------------------------------------------------------------------ guard: dead daemon


def test_dead_daemon_one_warning_retry_interval_no_stall(
    caplog: pytest.LogCaptureFixture, silent_listener: str
) -> None:
    monotonic = FakeMonotonic()
    client = CountingClient(silent_listener, timeout=0.2)
    guard = simple_guard(client, daemon_retry_seconds=5.0, monotonic=monotonic)
    with caplog.at_level(logging.INFO, logger=TRAIN_LOGGER):
        for _ in range(40):
            started = time.monotonic()
            with guard.step():
                pass
            assert guard.should_save() is False
            assert guard.should_stop() is False
            assert time.monotonic() - started < 1.0  # a hung daemon never stalls a step
            monotonic.advance(0.5)
    # 40 steps, 0.5 s apart: 20 s, a retry every 5 s.
    assert client.requests == 4
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "unreachable" in warnings[0].getMessage()
    assert "no answer within 0.2 s" in warnings[0].getMessage()


def test_daemon_down_keeps_last_deadline_and_recovers(caplog: pytest.LogCaptureFixture) -> None:
    deadline = time.time() + 1000
    monotonic = FakeMonotonic()
    with static_daemon(deadline) as daemon:
        port = int(daemon.url.rsplit(":", 1)[1])
        guard = simple_guard(SidecarClient(daemon.url), monotonic=monotonic)
        guard.record_step(1.0)
        assert guard.should_save() is False
        assert guard.status().deadline_source == "daemon"

    with caplog.at_level(logging.INFO, logger=TRAIN_LOGGER):
        monotonic.advance(1.0)
        for _ in range(20):
            guard.should_save()
        status = guard.status()
        assert status.daemon_reachable is False
        assert status.deadline_unix == pytest.approx(deadline, abs=1e-3)  # kept
        assert status.deadline_source == "daemon"
        assert status.last_error is not None and "connection refused" in status.last_error

        with static_daemon(deadline + 60, listen=(("127.0.0.1", port),)):
            monotonic.advance(5.0)  # the retry is due
            guard.should_save()
            status = guard.status()
            assert status.daemon_reachable is True
            assert status.deadline_unix == pytest.approx(deadline + 60, abs=1e-3)
            assert status.last_error is None

    # The deadline's lines only: a job-events sender that another test's client left
    # running may log a failed post to its own (gone) daemon meanwhile.
    messages = [(r.levelno, r.getMessage()) for r in caplog.records
                if r.name.startswith(TRAIN_LOGGER) and r.name != "sidecar.train.client"]
    assert [level for level, _ in messages] == [logging.WARNING, logging.INFO]
    assert "using the last known deadline" in messages[0][1]
    assert "reachable again" in messages[1][1]


def test_daemon_down_prefers_an_earlier_env_deadline() -> None:
    now = time.time()
    monotonic = FakeMonotonic()
    with static_daemon(now + 5000) as daemon:
        guard = CheckpointGuard(
            SidecarClient(daemon.url), monotonic=monotonic, environ={MLP: str(now + 3000)}
        )
        guard.should_save()
        assert guard.status().deadline_source == "daemon"  # reachable: the daemon wins
    monotonic.advance(1.0)
    guard.should_save()
    status = guard.status()
    assert status.deadline_source == "env"
    assert status.deadline_unix == pytest.approx(now + 3000)


def test_stale_answer_without_deadline_keeps_the_last_known_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The daemon restarts without a state file and its only source fails (the cloud API,
    # here the env source with a bad value): it answers expires_at null, stale true. The
    # guard keeps the deadline it knew, exactly as when the daemon is unreachable: the
    # earlier of that one and the environment's.
    deadline = time.time() + 1000
    monotonic = FakeMonotonic()
    with static_daemon(deadline) as daemon:
        port = int(daemon.url.rsplit(":", 1)[1])
        env_later = CheckpointGuard(
            SidecarClient(daemon.url), monotonic=monotonic, environ={MLP: str(deadline + 500)}
        )
        env_earlier = CheckpointGuard(
            SidecarClient(daemon.url), monotonic=monotonic, environ={MLP: str(deadline - 500)}
        )
        for guard in (env_later, env_earlier):
            guard.should_save()
            assert guard.status().deadline_source == "daemon"  # fresh: the daemon wins

    monkeypatch.setenv(MLP, "garbage")  # read by the restarted daemon's env source
    with serve_daemon(sources=("env",), listen=(("127.0.0.1", port),)) as restarted:
        probe = SidecarClient(restarted.url)
        wait_for(lambda: (probe.expiry() or Expiry.from_json({"server_time_unix": 1})).error)
        answer = probe.expiry()
        assert answer is not None and answer.stale and answer.expires_at_unix is None
        monotonic.advance(1.0)  # the next refresh is due
        for guard in (env_later, env_earlier):
            guard.should_save()
        kept = env_later.status()
        assert kept.daemon_reachable is True
        assert kept.deadline_unix == pytest.approx(deadline, abs=1e-3)
        assert kept.deadline_source == "daemon"
        earlier = env_earlier.status()
        assert earlier.deadline_unix == pytest.approx(deadline - 500)
        assert earlier.deadline_source == "env"


def test_guard_with_one_node_down_keeps_its_deadline_and_retries_slowly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = time.time()
    monotonic = FakeMonotonic()
    with static_daemon(now + 900) as late:
        with static_daemon(now + 300) as early:
            early_url = early.url
            client = CountingClient([late.url, early.url])
            guard = simple_guard(client, monotonic=monotonic)
            guard.should_save()
            assert guard.status().daemon_reachable is True
        with caplog.at_level(logging.WARNING, logger=TRAIN_LOGGER):
            for _ in range(10):
                monotonic.advance(1.0)
                guard.should_save()
        status = guard.status()
        assert status.deadline_unix == pytest.approx(now + 300, abs=1e-3)
        assert status.deadline_source == "daemon"
        assert status.daemon_reachable is False  # not every daemon answers
        assert status.last_error == f"{early_url}: connection refused"
        # After a failure, the retry interval (5 s), not the refresh interval (1 s): a
        # hung node must not cost a timeout every second.
        assert client.requests == 3  # at 1000, 1001 (fails) and 1006
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and early_url in warnings[0].getMessage()


def test_partial_answer_and_earlier_env_deadline() -> None:
    # One node down: its kept deadline is a last known one, so an earlier environment
    # deadline wins, as when the only daemon is unreachable.
    now = time.time()
    monotonic = FakeMonotonic()
    with static_daemon(now + 900) as late:
        with static_daemon(now + 600) as early:
            guard = CheckpointGuard(
                SidecarClient([late.url, early.url]),
                monotonic=monotonic,
                environ={MLP: str(now + 450)},
            )
            guard.should_save()
            assert guard.status().deadline_source == "daemon"
        monotonic.advance(1.0)
        guard.should_save()
        status = guard.status()
        assert status.deadline_source == "env"
        assert status.deadline_unix == pytest.approx(now + 450)


def test_stale_daemon_answer_is_used_and_logged_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # A second source (env) failing makes the daemon's picture stale; static still gives
    # the deadline.
    monkeypatch.setenv(MLP, "garbage")
    monotonic = FakeMonotonic()
    deadline = time.time() + 1000
    with static_daemon(deadline, sources=("static", "env")) as daemon:
        client = SidecarClient(daemon.url)
        wait_for(lambda: (client.expiry() or Expiry.from_json({"server_time_unix": 1})).error)
        guard = simple_guard(client, monotonic=monotonic)
        with caplog.at_level(logging.INFO, logger=TRAIN_LOGGER):
            for _ in range(3):
                guard.should_save()
                monotonic.advance(1.0)
            assert guard.status().deadline_unix == pytest.approx(deadline, abs=1e-3)
            monkeypatch.delenv(MLP)  # the daemon's next poll of env succeeds

            def fresh_again() -> bool:
                monotonic.advance(1.0)
                guard.should_save()
                return "fresh again" in caplog.text

            wait_for(fresh_again)
    stale = [r for r in caplog.records if "stale" in r.getMessage()]
    assert len(stale) == 1 and stale[0].levelno == logging.WARNING
    assert MLP in stale[0].getMessage()


def test_tracker_reads_the_environment_once_or_at_every_call() -> None:
    monotonic = FakeMonotonic()
    client = SidecarClient(f"http://127.0.0.1:{closed_port()}")
    environ = {MLP: "1900000000"}
    once = DeadlineTracker(client, monotonic=monotonic, environ=environ)
    live = DeadlineTracker(client, monotonic=monotonic, environ=environ, live_environ=True)
    environ[MLP] = "1800000000"
    assert once.deadline() == (1_900_000_000.0, "env")  # the guard's: read at construction
    assert live.deadline() == (1_800_000_000.0, "env")  # verl's: read at every call


def test_guard_arguments_are_validated() -> None:
    client = SidecarClient(f"http://127.0.0.1:{closed_port()}")
    with pytest.raises(ValueError, match="refresh_seconds"):
        CheckpointGuard(client, refresh_seconds=-1)
    with pytest.raises(ValueError, match="daemon_retry_seconds"):
        CheckpointGuard(client, daemon_retry_seconds=float("inf"))


def test_default_guard_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ESI_SIDECAR_URL", f"http://127.0.0.1:{closed_port()}")
    monkeypatch.setenv(MLP, str(time.time() + 100))
    guard = CheckpointGuard()
    assert guard.client.urls == (monkeypatch_url := guard.client.urls[0],)
    assert monkeypatch_url.startswith("http://127.0.0.1:")
    guard.record_step(1.0)
    assert guard.should_save() is True
    assert guard.status().deadline_source == "env"


# ------------------------------------------------------------------ reducer (ranks)


@pytest.mark.parametrize("daemon_rank", [0, 1])
def test_ranks_decide_alike_and_stop_together(daemon_rank: int) -> None:
    # Rank 0 saves (DDP style: rank 0 writes the checkpoint); one rank talks to a daemon,
    # the other's daemon is unreachable. Both must be told to save and to stop together,
    # also when the saving rank is the one that knows no deadline (the save is recorded
    # for the deadline the reduced decision used).
    reduce = ThreadAllReduce(2)
    told_to_save: dict[int, list[int]] = {0: [], 1: []}
    stopped_at: dict[int, int] = {}
    with static_daemon(time.time() + 200) as daemon:
        urls = [f"http://127.0.0.1:{closed_port()}"] * 2
        urls[daemon_rank] = daemon.url

        def train(rank: int) -> None:
            guard = CheckpointGuard(
                SidecarClient(urls[rank]),
                SavePolicy(save_seconds=100.0, top_up_seconds=None),
                environ={},
                reducer=reduce.for_rank(rank),
                wait_for_release=False,  # the stop decision itself, agreed by both
            )
            for step in range(10):
                with guard.step():
                    pass
                if guard.should_save():
                    told_to_save[rank].append(step)
                    if rank == 0:
                        with guard.saving():
                            pass
                status = guard.status()  # local, never collective: only the rank
                # that knows the deadline (and did not write the save) may say "save"
                assert status.save_now is False or rank == daemon_rank
                if guard.should_stop():
                    stopped_at[rank] = step
                    return

        errors = reduce.run(train)
    assert not errors, errors
    assert told_to_save == {0: [0], 1: [0]}
    assert stopped_at == {0: 0, 1: 0}
    assert reduce.calls == [2, 2]  # once per should_save, once per should_stop (near: no skip)


@pytest.mark.parametrize(
    ("release", "saves", "stop"),
    [
        # The final save at 100 s (190 s left <= 20 + 60 + 120), the top-up at 230 s (60 s
        # left <= 20 + 36 + 10), then 30 s left: stop.
        (290.0, [(4, False), (9, True)], 9),
        # Learned late: the final save at 20 s (90 s left); 60 s left after it, less than
        # a step plus a save: stop at once. Rank 1 alone (no final save recorded) would
        # count every step as trained since, and ask for a top-up save here.
        (110.0, [(0, False)], 0),
    ],
)
def test_ranks_agree_on_the_top_up_save_when_only_rank_0_writes_checkpoints(
    release: float, saves: list[tuple[int, bool]], stop: int
) -> None:
    # DDP style: only rank 0 saves, so only rank 0's policy records the final save. Rank
    # 1 learns of it through the reduction (steps since the final save, MIN): both train
    # on after the final save, both are told to make the top-up save at the same step,
    # and both stop together. Simulated time: 20 s steps, 30 s saves; releases not on a
    # boundary (the rule's window is inclusive, and large floats round).
    reduce = ThreadAllReduce(2)
    told: dict[int, list[tuple[int, bool]]] = {0: [], 1: []}
    stopped_at: dict[int, int] = {}
    start = time.time()
    with static_daemon(start + release) as daemon:

        def train(rank: int) -> None:
            elapsed = [0.0]
            guard = CheckpointGuard(
                SidecarClient(daemon.url), SavePolicy(top_up_seconds=10.0), environ={},
                reducer=reduce.for_rank(rank),
                clock=lambda: start + elapsed[0], wait_for_release=False,
            )
            for step in range(30):
                elapsed[0] += 20.0
                guard.record_step(20.0)
                if guard.should_save():
                    decision = guard.last_decision
                    assert decision is not None
                    told[rank].append((step, decision.top_up))
                    elapsed[0] += 30.0  # rank 1 waits for rank 0's save
                    if rank == 0:
                        guard.record_save(30.0, step=step)
                if guard.should_stop():
                    stopped_at[rank] = step
                    return

        errors = reduce.run(train)
    assert not errors, errors
    assert told == {0: saves, 1: saves}
    assert stopped_at == {0: stop, 1: stop}


def test_top_up_save_is_logged_and_shown_in_the_status(caplog: pytest.LogCaptureFixture) -> None:
    start = time.time()
    elapsed = [0.0]
    with static_daemon(start + 290) as daemon:
        guard = simple_guard(SidecarClient(daemon.url), policy=SavePolicy(top_up_seconds=10.0),
                             clock=lambda: start + elapsed[0])
        saved = []
        with caplog.at_level(logging.INFO, logger=TRAIN_LOGGER):
            for step in range(30):
                elapsed[0] += 20.0
                guard.record_step(20.0)
                if guard.should_save():
                    elapsed[0] += 30.0
                    guard.record_save(30.0, step=step)
                    saved.append(step)
                if guard.should_stop():
                    break
        status = guard.status()
    assert saved == [4, 9] and step == 9
    assert (status.final_step, status.top_up_step) == (4, 9)
    assert status.top_up_durable_at_unix == pytest.approx(start + 260.0)  # no uploader
    messages = [r.getMessage() for r in caplog.records]
    assert any(m.startswith("top-up checkpoint now: remaining 60.0 s") for m in messages)
    assert any(m.startswith("top-up checkpoint (step 9) durable 30.0 s before the release")
               for m in messages), messages


def test_reducer_sentinels_for_unknown_values() -> None:
    seen: list[tuple[float, ...]] = []

    def record(values: Sequence[float], ops: Sequence[Op], /) -> list[float]:
        seen.append(tuple(values))
        return list(values)

    guard = simple_guard(SidecarClient(f"http://127.0.0.1:{closed_port()}"), reducer=record)
    assert guard.should_save() is False
    assert seen == [(UNKNOWN_REMAINING, UNKNOWN_STEP, UNKNOWN_SAVE, UNKNOWN_COVERED,
                     UNKNOWN_UPLOAD, UNKNOWN_AFTER_FINAL, UNKNOWN_STEP, UNKNOWN_REMAINING,
                     UNKNOWN_ROUTINE, 0.0, UNKNOWN_PROCESS)]  # 0: nothing trained yet, known
    assert guard.last_decision is not None
    assert guard.last_decision.reason == "no deadline known"
    guard.status()
    assert len(seen) == 1  # status() never calls the reducer


def test_reduced_values_drive_the_decision() -> None:
    # This rank knows nothing; a peer rank knows the deadline, a step and a save.
    def peer_knows(values: Sequence[float], ops: Sequence[Op], /) -> list[float]:
        remaining, step, save, covered, upload, after_final, typical, drill, *rest = values
        return [min(remaining, 140.0), max(step, 20.0), max(save, 5.0), max(covered, -1e9),
                upload, after_final, max(typical, 20.0), drill, *rest]

    guard = simple_guard(SidecarClient(f"http://127.0.0.1:{closed_port()}"), reducer=peer_knows)
    assert guard.should_save() is True
    decision = guard.last_decision
    assert decision is not None
    assert decision.remaining_seconds == 140.0
    assert decision.budget_seconds == pytest.approx(20 + 5 + 120)


def test_guard_state_travels_with_the_checkpoint(caplog: pytest.LogCaptureFixture) -> None:
    """What the guard learned is plain JSON that seeds a new guard after a resume: its
    first decision uses the measured save, not the 60 s default."""
    dead = SidecarClient(f"http://127.0.0.1:{closed_port()}")
    before = simple_guard(dead, policy=SavePolicy(save_seconds=60.0))
    for seconds in (3.0, 4.0):
        before.record_step(seconds)
    before.record_save(240.0, started_unix=1000.0)  # a 4-minute save
    state = json.loads(json.dumps(before.state_dict()))
    assert state["policy"] == {"steps": [3.0, 4.0], "saves": [240.0]}

    after = simple_guard(dead, policy=SavePolicy(save_seconds=60.0))
    assert after.policy.save_estimate() == 60.0
    assert after.load_state_dict(state) is True
    assert after.policy.step_estimate() == 4.0
    assert after.policy.save_estimate() == pytest.approx(240.0 * 1.2)

    caplog.set_level(logging.WARNING, logger="sidecar.train.guard")
    for bad in (None, [], {"version": 99}, {"version": 1, "policy": {"steps": ["x"]}},
                {"version": 1, "policy": {"saves": [-1.0]}},
                {"version": 1, "policy": {}, "upload_seconds": float("nan")}):
        fresh = simple_guard(dead)
        assert fresh.load_state_dict(bad) is False
        assert fresh.policy.step_estimate() is None and fresh.policy.save_estimate() == 60.0
    assert sum("ignoring the saved guard state" in r.getMessage() for r in caplog.records) == 6


@contextmanager
def trickling_peer(headers_first: bool) -> Iterator[str]:
    """A peer that answers one byte every 50 ms: the whole headers (or, after the headers
    at once, the body) would take seconds. Bounded: it stops after 3 s or when told."""
    body = good_body()
    head = (f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    listener.settimeout(0.1)
    done = threading.Event()

    def serve() -> None:
        stop_at = time.monotonic() + 3.0
        while not done.is_set() and time.monotonic() < stop_at:
            try:
                conn, _ = listener.accept()
            except OSError:
                continue
            with conn:
                conn.recv(4096)
                slow = head + body if headers_first else body
                if not headers_first:
                    conn.sendall(head)
                for byte in slow:
                    if done.is_set() or time.monotonic() > stop_at:
                        break
                    try:
                        conn.sendall(bytes([byte]))
                    except OSError:
                        break
                    time.sleep(0.05)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        done.set()
        thread.join(5)
        listener.close()


@pytest.mark.parametrize("headers_first", [True, False], ids=["headers", "body"])
def test_a_trickling_daemon_cannot_stretch_the_timeout(headers_first: bool) -> None:
    """The timeout bounds the whole request, not each read: a peer that sends a byte every
    50 ms (the answer would take seconds) costs one timeout, and the guard goes on."""
    with trickling_peer(headers_first) as url:
        client = SidecarClient(url, timeout=0.3)
        started = time.monotonic()
        assert client.expiry() is None
        took = time.monotonic() - started
        assert client.last_error is not None and "no answer within 0.3 s" in client.last_error
        # The byte-by-byte answer needs more than 15 s; one bounded request is far less.
        assert took < 1.5, took
        guard = simple_guard(client, refresh_seconds=0.0, daemon_retry_seconds=0.0)
        started = time.monotonic()
        guard.should_save()
        assert time.monotonic() - started < 1.5


class _MovableDeadline:
    """What the guard reads of a client, for a deadline a test moves (each rank its own)."""

    urls = ("test",)
    last_error = None

    def __init__(self, deadline: float, clock: Callable[[], float]) -> None:
        self.deadline = deadline
        self._clock = clock

    def expiry(self) -> Expiry:
        now = self._clock()
        return Expiry(expires_at=None, expires_at_unix=self.deadline,
                      remaining_seconds=self.deadline - now, kind="scheduled-release",
                      source="test", instance_id=None, scheduled_instance_id=None,
                      observed_at=None, age_seconds=0.0, stale=False, error=None,
                      server_time_unix=now)

    def is_durable(self, step: int) -> Optional[bool]:
        return None


def test_while_the_deadline_is_far_the_ranks_reduce_on_a_schedule_they_all_compute() -> None:
    """Simulated clock, two thread ranks, 1 s steps, the release 2000 s away: the ranks
    agree once every few steps (never more than MAX_SKIP_SECONDS of steps apart), always
    in the same decisions; when the release is moved close on one rank's side only, both
    learn it at the next scheduled reduction and save at the same step."""
    from sidecar.train.guard import MAX_SKIP_SECONDS

    reduce = ThreadAllReduce(2)
    now = [1_000_000.0]
    deadlines = {rank: _MovableDeadline(now[0] + 2000.0, lambda: now[0]) for rank in (0, 1)}
    saves: dict[int, list[int]] = {0: [], 1: []}
    reduced_at: dict[int, list[int]] = {0: [], 1: []}
    in_step = threading.Barrier(2, timeout=10)

    def train(rank: int) -> None:
        guard = CheckpointGuard(
            deadlines[rank],  # type: ignore[arg-type]
            SavePolicy(save_seconds=10.0, redundant_seconds=20.0, top_up_seconds=None),
            environ={}, clock=lambda: now[0], reducer=reduce.for_rank(rank),
            refresh_seconds=0.0, wait_for_release=False)
        for step in range(120):
            guard.record_step(1.0)
            before = guard.reductions
            if guard.should_save():
                saves[rank].append(step)
                with guard.saving(step):
                    pass
            guard.should_stop()
            if guard.reductions > before:
                reduced_at[rank].append(step)
            in_step.wait()
            if rank == 0:
                now[0] += 1.0
                if step == 60:
                    deadlines[1].deadline = now[0] + 40.0  # only rank 1's node learns it
            in_step.wait()

    errors = reduce.run(train, timeout=60)
    assert not errors, errors
    assert reduced_at[0] == reduced_at[1]  # the same collectives, on every rank
    far = [step for step in reduced_at[0] if step <= 60]
    gaps = [b - a for a, b in zip(far, far[1:])]
    assert max(gaps) <= MAX_SKIP_SECONDS + 1, reduced_at  # never longer apart
    assert len(far) <= 61 / MAX_SKIP_SECONDS + 1, reduced_at  # 1 step in ~5, not every one
    assert saves[0] == saves[1] and len(saves[0]) == 1, saves
    # Learned at the next scheduled reduction (within MAX_SKIP_SECONDS of steps), and saved
    # at the very step the rule saves at without any skipping: the first with remaining <=
    # budget (1 s step + 10 s save + 20 s margin): 1_000_101 - (1_000_000 + 70) = 31.
    learned = min(step for step in reduced_at[0] if step > 60)
    assert learned <= 61 + MAX_SKIP_SECONDS, reduced_at
    assert saves[0] == [70], (saves, reduced_at[0][8:])


def test_a_deadline_back_inside_the_old_cover_after_a_renewal_gets_its_own_save() -> None:
    # Found on a real Slurm job: the final save, a renewal (TimeLimit=+5), training on,
    # then a deadline back within the old save's cover (a preemption's SIGTERM soon after
    # the renewal). The training since the renewal is in no checkpoint: save, not stop.
    now = time.time()
    wall = [now]
    monotonic = FakeMonotonic()
    with _final_save_made(now, wall, monotonic) as (daemon, guard):
        daemon.store.record_success("static", Observation(expires_at_unix=now + 7400))
        monotonic.advance(1.0)
        assert guard.should_stop() is False  # renewed: training goes on
        for _ in range(5):
            guard.record_step(1.0)
            wall[0] += 2.0
            assert guard.should_save() is False

        daemon.store.record_success("static", Observation(expires_at_unix=wall[0] + 100))
        monotonic.advance(1.0)
        assert guard.should_save() is True, guard.status()


def late_save_asked(client: SidecarClient, environ: dict[str, str]) -> Any:
    """The default policy with a 55 s save (46 s unpadded) and 50 s left: a late save."""
    guard = simple_guard(client, policy=SavePolicy(save_seconds=55.0), environ=environ,
                         events=False)
    guard.record_step(1.0)
    guard.should_save()
    return guard.last_decision


def test_auto_late_saves_follow_whose_deadline_it_is(monkeypatch: pytest.MonkeyPatch) -> None:
    # The machine's release (the daemon's static source): the late save is started.
    with static_daemon(time.time() + 50.0) as daemon:
        decision = late_save_asked(SidecarClient(daemon.url), {})
        assert decision is not None and decision.save_now and not decision.too_late
    # A deadline that ends the process, not the machine: none, so the job leaves cleanly.
    # The guard's own environment (no daemon answers)...
    unreachable = SidecarClient(f"http://127.0.0.1:{closed_port()}")
    decision = late_save_asked(unreachable, {MLP: str(time.time() + 50.0)})
    assert decision is not None and decision.too_late and not decision.save_now
    # ...and a daemon whose source is the environment (as its slurm source would be).
    monkeypatch.setenv(MLP, str(time.time() + 50.0))
    with serve_daemon(sources=("env",)) as daemon:
        client = SidecarClient(daemon.url)
        wait_for(lambda: client.deadline_unix() is not None)
        decision = late_save_asked(client, {})
        assert decision is not None and decision.too_late and not decision.save_now


def test_a_save_timed_by_its_caller_covers_the_deadline_of_the_decision_that_asked() -> None:
    """``record_save(seconds)`` takes the save to have started ``seconds`` ago, which can be
    before ``should_save()`` asked for it (a save timed from a wider span). The final save
    still covers the deadline its decision saw: no second final save (a CI run saved twice
    for one drill, the decision at remaining == budget)."""
    now = time.time()
    wall = [now]
    with static_daemon(now + 220.99) as daemon:  # 1 s step + 100 s save + 120 s margin
        guard = simple_guard(SidecarClient(daemon.url),
                             policy=SavePolicy(save_seconds=100.0, top_up_seconds=None),
                             clock=lambda: wall[0])
        guard.record_step(1.0)
        assert guard.should_save() is True
        assert guard.last_decision is not None and guard.last_decision.budget_seconds == 221.0
        guard.record_save(30.0, step=1)  # "started" 30 s before it was asked
        guard.record_step(1.0)  # a step after it: only the final save's cover holds
        assert guard.should_save() is False
        assert guard.should_stop() is True
