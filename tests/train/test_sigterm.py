"""SIGTERM as a deadline (``CheckpointGuard(sigterm_grace_seconds=...)``): real signals,
sent to this process and to the plain example run as a program; no daemon at all."""

from __future__ import annotations

import logging
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from sidecar.checkpoint.folders import latest_valid
from sidecar.train.client import SidecarClient
from sidecar.train.guard import EXIT_RELEASED, CheckpointGuard
from sidecar.train.policy import SavePolicy
from sidecar.train.sigterm import SigtermDeadline

ROOT = Path(__file__).resolve().parents[2]


def dead_url() -> str:
    import socket

    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def test_sigterm_becomes_the_deadline_and_the_job_leaves_after_one_save() -> None:
    # A 5 s save (assumed; a 60 s one would not fit the 30 s grace, and none is started).
    guard = CheckpointGuard(SidecarClient(dead_url()), SavePolicy(save_seconds=5), environ={},
                            sigterm_grace_seconds=30)
    try:
        assert guard.sigterm is not None and guard.sigterm.installed
        guard.record_step(0.5)
        assert guard.should_save() is False  # no deadline anywhere
        assert guard.should_stop() is False
        sent = time.time()
        os.kill(os.getpid(), signal.SIGTERM)  # handled: the process lives on
        status = guard.status()
        assert status.deadline_source == "sigterm"
        assert status.remaining_seconds is not None and 28 < status.remaining_seconds <= 30
        assert guard.status().deadline_unix == pytest.approx(sent + 30, abs=1)
        assert guard.should_save() is True  # 30 s <= 0.5 + 5 + 120, and 5 s fit
        with guard.saving(7):
            pass
        started = time.monotonic()
        assert guard.should_stop() is True  # at once: no wait for a SIGTERM's deadline
        assert time.monotonic() - started < 1.0
        assert guard.released is True
    finally:
        guard.sigterm.uninstall()  # type: ignore[union-attr]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_a_second_sigterm_does_not_move_the_deadline() -> None:
    clock = [1000.0]
    term = SigtermDeadline(30.0, lambda: clock[0])
    assert term.deadline() is None
    term._handle(signal.SIGTERM, None)
    clock[0] += 10
    term._handle(signal.SIGTERM, None)
    assert term.deadline() == 1030.0


def test_an_earlier_daemon_deadline_still_wins() -> None:
    clock = [1_900_000_000.0]
    guard = CheckpointGuard(SidecarClient(dead_url()), environ={
        "MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP": str(1_900_000_010)},
        sigterm_grace_seconds=30, clock=lambda: clock[0], wait_for_release=False)
    try:
        guard.sigterm._handle(signal.SIGTERM, None)  # type: ignore[union-attr]
        status = guard.status()
        assert (status.deadline_source, status.deadline_unix) == ("env", 1_900_000_010)
    finally:
        guard.sigterm.uninstall()  # type: ignore[union-attr]


def test_outside_the_main_thread_it_warns_and_works_without(
    caplog: pytest.LogCaptureFixture,
) -> None:
    built: list[CheckpointGuard] = []
    with caplog.at_level(logging.WARNING, logger="sidecar.train"):
        thread = threading.Thread(target=lambda: built.append(CheckpointGuard(
            SidecarClient(dead_url()), environ={}, sigterm_grace_seconds=30)))
        thread.start()
        thread.join(10)
    assert built[0].sigterm is not None and not built[0].sigterm.installed
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    assert any("main thread" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("grace", [-1.0, math.inf, math.nan])
def test_a_bad_grace_is_refused_naming_it(grace: float) -> None:
    with pytest.raises(ValueError, match="sigterm_grace_seconds"):
        CheckpointGuard(SidecarClient(dead_url()), environ={}, sigterm_grace_seconds=grace)


def test_every_rank_learns_one_ranks_sigterm_through_the_reduction() -> None:
    # Rank 1's node got the SIGTERM; rank 0 knows nothing. Both are told to save at the
    # same decision, for the same deadline (MIN of the remaining times).
    from test_guard import ThreadAllReduce

    reduce = ThreadAllReduce(2)
    now = 2_000_000.0
    guards = [
        CheckpointGuard(SidecarClient(dead_url()), SavePolicy(save_seconds=5), environ={},
                        clock=lambda: now, reducer=reduce.for_rank(rank),
                        wait_for_release=False)
        for rank in (0, 1)
    ]
    guards[1].sigterm = SigtermDeadline(25.0, lambda: now)
    guards[1].sigterm._handle(signal.SIGTERM, None)
    answers: dict[int, tuple[bool, float]] = {}

    def rank(index: int) -> None:
        guard = guards[index]
        guard.record_step(1.0)
        save = guard.should_save()
        decision = guard.last_decision
        assert decision is not None and decision.remaining_seconds is not None
        answers[index] = (save, decision.remaining_seconds)

    assert reduce.run(rank) == []
    assert answers == {0: (True, 25.0), 1: (True, 25.0)}


def test_the_plain_example_saves_and_exits_75_on_sigterm(tmp_path: Path) -> None:
    """The example as a program: SIGTERM mid-training, one save, EXIT_RELEASED at once."""
    checkpoints = tmp_path / "checkpoints"
    env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(ROOT),
           "ESI_SIDECAR_URL": dead_url()}
    process = subprocess.Popen(
        [sys.executable, str(ROOT / "examples" / "plain_pytorch.py"), "--steps", "1000000000",
         "--sigterm-grace", "20", "--save-seconds", "1", "--checkpoints", str(checkpoints)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        assert process.stderr is not None
        first = ""
        for _ in range(50):  # imports done once the loop says where it starts
            first += process.stderr.readline()
            if "training steps 0 to" in first or process.poll() is not None:
                break
        assert "training steps 0 to" in first, first
        time.sleep(0.5)  # training steps running
        assert process.poll() is None, process.communicate()
        sent = time.monotonic()
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=30)
        err = first + err
        took = time.monotonic() - sent
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == EXIT_RELEASED, err[-2000:]
    assert took < 10.0, err[-2000:]  # well inside the 20 s grace
    assert "SIGTERM received" in err and "deadline from sigterm" in out
    saved = latest_valid(checkpoints)
    assert saved is not None and saved.step > 0
