"""The guard's own protection line: its SIGTERM grace held against its measured step and
save, said once per change, a warning when the grace cannot hold a save (issue 24, item 2)."""

from __future__ import annotations

import logging
import re
import signal

import pytest

from sidecar.train.client import SidecarClient
from sidecar.train.guard import CheckpointGuard
from sidecar.train.policy import SavePolicy


def dead_url() -> str:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


def test_a_grace_shorter_than_the_save_is_said_once_then_again_when_it_holds(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "sidecar.train.guard")
    now = [1_900_000_000.0]
    guard = CheckpointGuard(SidecarClient(dead_url()), SavePolicy(save_seconds=60.0),
                            environ={}, sigterm_grace_seconds=30, clock=lambda: now[0],
                            events=False)
    try:
        guard.record_step(5.0)
        guard.record_save(60.0, step=1200, started_unix=now[0])
        now[0] += 41 * 60
        for _ in range(3):
            guard.should_save()
        lines = [r for r in caplog.records if r.getMessage().startswith("SIGTERM:")]
        assert [r.levelno for r in lines] == [logging.WARNING]
        assert re.fullmatch(r"SIGTERM: 30 s notice < (\d+) s step \+ save: a reclaim now "
                            r"loses the 41 min since step 1200", lines[0].getMessage())
        for _ in range(5):  # the save estimate follows the measured saves, now 1 s
            guard.record_save(1.0, step=1300)
        guard.should_save()
        lines = [r for r in caplog.records if r.getMessage().startswith("SIGTERM:")]
        assert len(lines) == 2 and lines[1].levelno == logging.INFO
        assert lines[1].getMessage().startswith("SIGTERM: 30 s notice >= ")
    finally:
        if guard.sigterm is not None:
            guard.sigterm.uninstall()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
