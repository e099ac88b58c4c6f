"""The guard's log lines read plainly (issue 39, "Smaller"): "unreachable" only after a
request failed, a past release said as past, a checkpoint without a step said so, and
each line of a job of several ranks names its rank."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Optional

import pytest
from guard_support import closed_port

from sidecar.cli.restore_account import close_release_account
from sidecar.host.features.reclaims.ledger import ReclaimLedger
from sidecar.models import Expiry
from sidecar.timeparse import format_rfc3339
from sidecar.train.client import SidecarClient
from sidecar.train.deadline import DeadlineTracker
from sidecar.train.guard import CheckpointGuard
from sidecar.train.job_events import JobEvents
from sidecar.train.policy import PolicyDecision, SavePolicy
from sidecar.train.reclaim_cost import release_cost
from sidecar.train.release_wait import ReleaseWait


class NoDaemonAskedYet:
    """A client that asked no daemon (as the Ray client before it knows a node): no
    answer, and no request that failed."""

    last_error: Optional[str] = None
    urls: tuple[str, ...] = ()

    def expiry(self) -> Optional[Expiry]:
        return None


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_unreachable_is_said_only_after_a_request_failed(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    never_asked = DeadlineTracker(NoDaemonAskedYet(), environ={})  # type: ignore[arg-type]
    assert never_asked.deadline() == (None, None)
    assert not any("unreachable" in line for line in warnings_of(caplog))
    dead = DeadlineTracker(SidecarClient(f"http://127.0.0.1:{closed_port()}"), environ={})
    assert dead.deadline() == (None, None)
    said = [line for line in warnings_of(caplog) if "unreachable" in line]
    assert len(said) == 1 and "connection refused" in said[0], said


def stop_decision(remaining_seconds: float) -> PolicyDecision:
    return PolicyDecision(save_now=False, stop=True, remaining_seconds=remaining_seconds,
                          budget_seconds=None, step_seconds=None, save_seconds=1.0,
                          reason="final save done")


def test_a_release_already_past_is_said_as_past(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="sidecar.train.guard")
    now = time.time()
    events = JobEvents(None, enabled=False, job="j", clock=time.time,
                       monotonic=time.monotonic)
    wait = ReleaseWait(events, clock=time.time, sleep=time.sleep, collective=False)
    left = wait.wait((stop_decision(-201.0), now - 201.0), refresh_seconds=0.1,
                     decide=lambda: (stop_decision(-201.0), now - 201.0),
                     follow=lambda: None)
    lines = [r.getMessage() for r in caplog.records]
    assert left is True
    assert "final checkpoint saved; the release passed 201 s ago" in lines, lines
    assert not any("-201" in line for line in lines), lines


def test_an_account_without_a_step_says_so(caplog: pytest.LogCaptureFixture,
                                           tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    caplog.set_level(logging.INFO, logger="sidecar.host.reclaims")
    now = time.time()
    ledger = ReclaimLedger()
    assert ledger.record(release_cost(released_unix=now - 10, state_unix=now - 70,
                                      resumed_step=None, job="j"))
    lines = [r.getMessage() for r in caplog.records]
    assert any("from a checkpoint that names no step" in line for line in lines), lines
    assert not any("step None" in line for line in lines), lines
    # The restore's own line, from a manifest that names no step (no daemon to post to).
    manifest = {"started_at": format_rfc3339(now - 70)}
    (tmp_path / "MANIFEST.json").write_text(json.dumps(manifest))
    close_release_account(tmp_path, format_rfc3339(now - 10), [], timeout=0.2)
    printed = capsys.readouterr().out
    assert "of a checkpoint that names no step" in printed and "None" not in printed


def test_the_guards_lines_name_the_rank_in_a_job_of_several(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    caplog.set_level(logging.INFO)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "8")
    guard = CheckpointGuard(SidecarClient(f"http://127.0.0.1:{closed_port()}"),
                            SavePolicy(save_seconds=1.0), environ={}, events=False)
    guard.load_state_dict("not a state")  # one warning on the guard's logger
    guard.should_save()  # the tracker's "unreachable" warning
    said = warnings_of(caplog)
    assert len(said) == 2 and all(line.startswith("rank 3/8: ") for line in said), said
    caplog.clear()
    monkeypatch.setenv("WORLD_SIZE", "1")  # a single process: lines as they are
    guard.load_state_dict("not a state")
    assert [line[:9] for line in warnings_of(caplog)] == ["ignoring "]
