"""Durable before the release: the uploader's estimate in the decision, the bandwidth cap,
and the guard following the final checkpoint until the daemon has it in storage.

The real daemon with its uploader, the real boto3 against moto's S3 server on loopback, the
stdlib client and the guard; the guard's clock is set so the remaining time is exact.
"""

from __future__ import annotations

import json
import logging
import re
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import serve_daemon
from drill_support import job_heard, start_drill, verdict
from guard_support import static_daemon
from upload_support import (
    ACCESS_KEY,
    MIB,
    SECRET_KEY,
    S3Server,
    isolate_aws_env,
    make_checkpoint,
    wait_for,
)

from sidecar.host.settings import ConfigError, load_settings
from sidecar.host.upload.location import S3Location
from sidecar.host.upload.plan import ESTIMATE_MARGIN as UPLOAD_MARGIN
from sidecar.host.upload.status import UploadRecord, UploadTracker
from sidecar.train.client import SidecarClient
from sidecar.train.guard import CheckpointGuard
from sidecar.train.policy import SavePolicy

CAP = 2 * MIB  # bytes per second: a 6 MiB checkpoint takes 3 s
GUARD_LOGGER = "sidecar.train.guard"


@pytest.fixture(autouse=True)
def _env(monkeypatch: pytest.MonkeyPatch) -> None:
    isolate_aws_env(monkeypatch)


def expiry(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "/v1/expiry", timeout=5) as response:
        body: dict[str, Any] = json.loads(response.read())
    return body


def settings(s3_endpoint: str, root: Path, location: S3Location, deadline: float,
             **extra: Any) -> dict[str, Any]:
    return {
        "sources": ("static",), "expires_at": str(deadline),
        "upload_from": root, "upload_to": location.url, "upload_endpoint": s3_endpoint,
        "upload_access_key": ACCESS_KEY, "upload_secret_key": SECRET_KEY,
        "upload_part_size": 5 * MIB, "upload_scan_interval": 0.2, **extra,
    }


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_the_decision_budgets_the_upload_and_the_final_save_is_followed_to_durable(
    s3: S3Server, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    deadline = time.time() + 3600
    location = s3.bucket("durable-final")
    make_checkpoint(tmp_path, 1, {"model.pt": 6 * MIB})
    started = time.monotonic()
    with serve_daemon(**settings(s3.endpoint, tmp_path, location, deadline,
                                 upload_max_bandwidth=CAP)) as daemon:
        client = SidecarClient(daemon.url, timeout=5)
        wait_for(lambda: client.last_durable_step() == 1, timeout=30)
        took = time.monotonic() - started
        # The cap holds: 6 MiB at 2 MiB/s cannot be durable in much less than 3 s.
        assert took >= 6 / 2 * 0.8, took

        body = expiry(daemon.url)
        assert body["upload_status"] == "ok"
        upload = body["upload_seconds"]
        # The largest recent checkpoint over the measured rate (capped), with the margin.
        assert 6 / 2 * UPLOAD_MARGIN <= upload <= took * UPLOAD_MARGIN + 0.5
        query = "/v1/decision?step_seconds=1&save_seconds=1&redundant_seconds=5"
        with urllib.request.urlopen(daemon.url + query, timeout=5) as response:
            decided = json.loads(response.read())
        assert decided["upload_seconds"] == pytest.approx(upload, rel=0.01)
        assert decided["budget_seconds"] == pytest.approx(7.0 + upload, rel=0.01)

        # 9 s left. The local save alone fits (1 s step + 1 s save + 5 s margin = 7 s), the
        # save plus its upload does not: the guard must ask for the save now.
        clock = Clock(deadline - 9.0)
        guard = CheckpointGuard(client, SavePolicy(save_seconds=1.0, redundant_seconds=5.0),
                                clock=clock, environ={})
        guard.record_step(1.0)
        caplog.set_level(logging.INFO, logger=GUARD_LOGGER)
        assert guard.should_save() is True
        decision = guard.last_decision
        assert decision is not None and decision.upload_seconds == pytest.approx(upload)
        assert decision.budget_seconds == pytest.approx(1.0 + 1.0 + upload + 5.0)
        status = guard.status()
        assert status.upload_seconds == pytest.approx(upload) and status.upload_status == "ok"

        with guard.saving(step=2):
            make_checkpoint(tmp_path, 2, {"model.pt": 6 * MIB})
        assert guard.status().final_step == 2

        def durable_at() -> Any:
            return guard.status().final_durable_at_unix

        assert wait_for(durable_at, timeout=30) == clock.now
        assert client.is_durable(2) is True
    lines = [r.getMessage() for r in caplog.records if r.name == GUARD_LOGGER]
    assert "final checkpoint (step 2) durable 9.0 s before the release" in lines


def test_storage_down_the_guard_warns_and_says_the_final_save_was_not_durable(
    tmp_path: Path, unused_port: int, caplog: pytest.LogCaptureFixture
) -> None:
    deadline = time.time() + 3600
    make_checkpoint(tmp_path, 1, {"w.bin": 10})
    dead = S3Location("nowhere", "run")
    with serve_daemon(**settings(f"http://127.0.0.1:{unused_port}", tmp_path, dead,
                                 deadline)) as daemon:
        wait_for(lambda: expiry(daemon.url)["upload_status"] == "degraded", timeout=20)
        clock = Clock(deadline - 100.0)
        guard = CheckpointGuard(SidecarClient(daemon.url, timeout=5),
                                SavePolicy(save_seconds=1.0, redundant_seconds=120.0),
                                clock=clock, refresh_seconds=0.0, environ={},
                                wait_for_release=False)  # the stop answers at once
        guard.record_step(1.0)
        caplog.set_level(logging.INFO, logger=GUARD_LOGGER)
        assert guard.should_save() is True
        assert guard.status().upload_status == "degraded"
        with guard.saving(step=2):
            make_checkpoint(tmp_path, 2, {"w.bin": 10})
        guard.should_stop()
        assert guard.status().final_durable_at_unix is None
        clock.now = deadline + 1.0  # the release came first
        guard.status()
        guard.status()
    messages = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == GUARD_LOGGER]
    failing = [m for level, m in messages if "uploads are failing" in m]
    assert len(failing) == 1 and all(level == logging.WARNING for level, m in messages
                                     if "uploads are failing" in m)
    not_durable = [(level, m) for level, m in messages if "NOT durable" in m]
    assert not_durable == [(logging.ERROR, "final checkpoint (step 2) was NOT durable before "
                                           "the release: the uploader had not finished "
                                           "(degraded)")]


def test_without_an_uploader_the_final_save_is_durable_at_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    deadline = time.time() + 3600
    with serve_daemon(sources=("static",), expires_at=str(deadline)) as daemon:
        body = expiry(daemon.url)
        assert body["upload_seconds"] is None and body["upload_status"] is None
        clock = Clock(deadline - 50.0)
        guard = CheckpointGuard(SidecarClient(daemon.url, timeout=5),
                                SavePolicy(save_seconds=1.0, redundant_seconds=60.0),
                                clock=clock, environ={})
        guard.record_step(1.0)
        caplog.set_level(logging.INFO, logger=GUARD_LOGGER)
        assert guard.should_save() is True
        decision = guard.last_decision
        assert decision is not None and decision.budget_seconds == pytest.approx(62.0)
        with guard.saving(step=7):
            pass
        status = guard.status()
        assert status.final_step == 7 and status.final_durable_at_unix == clock.now
    assert any(r.getMessage() == "final checkpoint (step 7) durable 50.0 s before the release "
               "(no uploader: the local save counts)" for r in caplog.records)


def test_an_asynchronous_save_counts_once_committed_and_its_write_is_budgeted(
    caplog: pytest.LogCaptureFixture
) -> None:
    deadline = time.time() + 3600
    with serve_daemon(sources=("static",), expires_at=str(deadline)) as daemon:
        clock = Clock(deadline - 50.0)
        guard = CheckpointGuard(SidecarClient(daemon.url, timeout=5),
                                SavePolicy(save_seconds=1.0, redundant_seconds=60.0),
                                clock=clock, environ={})
        guard.record_step(1.0)
        guard.record_async_write(4.0)  # an earlier save's background write
        guard.record_async_write(9.0)
        caplog.set_level(logging.INFO, logger=GUARD_LOGGER)
        assert guard.async_write_estimate() == 9.0  # the largest of the recent ones
        assert guard.should_save() is True
        decision = guard.last_decision
        # step 1 + save 1 + margin 60 + the background write 9, as an upload would be.
        assert decision is not None and decision.budget_seconds == pytest.approx(71.0)
        committed = {"done": False}
        guard.record_save(0.5, step=7, committed=lambda: committed["done"])
        status = guard.status()
        assert status.final_step == 7 and status.final_durable_at_unix is None
        clock.now += 2.0
        committed["done"] = True
        deadline_check = time.monotonic() + 5  # asked at most once per refresh (1 s)
        while guard.status().final_durable_at_unix is None and time.monotonic() < deadline_check:
            time.sleep(0.05)
        assert guard.status().final_durable_at_unix == clock.now
    assert any(r.getMessage() == "final checkpoint (step 7) durable 48.0 s before the release "
               "(no uploader: the local save counts)" for r in caplog.records)
    with pytest.raises(ValueError, match="async write seconds"):
        guard.record_async_write(float("nan"))


def test_an_asynchronous_save_not_committed_by_the_release_is_said_loudly(
    caplog: pytest.LogCaptureFixture
) -> None:
    deadline = time.time() + 3600
    with serve_daemon(sources=("static",), expires_at=str(deadline)) as daemon:
        clock = Clock(deadline - 50.0)
        guard = CheckpointGuard(SidecarClient(daemon.url, timeout=5),
                                SavePolicy(save_seconds=1.0, redundant_seconds=60.0),
                                clock=clock, environ={}, wait_for_release=False)
        guard.record_step(1.0)
        assert guard.should_save() is True

        def broken() -> bool:
            raise RuntimeError("a committed() that raises is taken as not committed")

        guard.record_save(0.5, step=7, committed=broken)
        caplog.set_level(logging.INFO, logger=GUARD_LOGGER)
        clock.now = deadline + 1.0
        assert guard.status().final_durable_at_unix is None
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR] == [
        "final checkpoint (step 7) was NOT committed before the release: its asynchronous "
        "write had not finished"]


def test_the_estimate_is_the_largest_recent_checkpoint_over_the_throughput() -> None:
    now = [1000.0]
    tracker = UploadTracker(source="/c", destination="s3://b/p", endpoint=None,
                            clock=lambda: now[0])
    assert tracker.next_upload_seconds() is None  # nothing seen
    tracker.put(UploadRecord("step_1", 1, 1.0, "d1", bytes_total=100 * MIB, file_count=1))
    assert tracker.next_upload_seconds() is None  # no rate known, no cap
    tracker.record_done("step_1", duration=10.0, note=None)  # 10 MiB/s
    assert tracker.next_upload_seconds() == pytest.approx(10.0 * UPLOAD_MARGIN)
    tracker.put(UploadRecord("step_2", 2, 2.0, "d2", bytes_total=300 * MIB, file_count=1))
    assert tracker.next_upload_seconds() == pytest.approx(30.0 * UPLOAD_MARGIN)
    capped = UploadTracker(source="/c", destination="s3://b/p", endpoint=None,
                           max_bandwidth=5 * MIB)
    capped.put(UploadRecord("step_1", 1, 1.0, "d1", bytes_total=100 * MIB, file_count=1))
    assert capped.next_upload_seconds() == pytest.approx(20.0 * UPLOAD_MARGIN)  # the cap
    capped.record_done("step_1", duration=2.0, note=None)  # measured 50 MiB/s, capped at 5
    assert capped.throughput() == 5 * MIB
    # The cap binds; the rate still rests on the one upload measured.
    assert capped.durability() == (pytest.approx(20.0 * UPLOAD_MARGIN), "ok", 1)


def test_a_bad_bandwidth_cap_stops_start_up_naming_the_setting() -> None:
    parsed = load_settings({"upload_max_bandwidth": "200MiB"}, environ={})
    assert parsed.upload_max_bandwidth == 200 * MIB
    assert load_settings({}, {"ESI_SIDECAR_UPLOAD_MAX_BANDWIDTH": "50MB/s"}
                         ).upload_max_bandwidth == 50_000_000
    for bad in ("fast", "-5MiB", "10"):
        with pytest.raises(ConfigError, match="--upload-max-bandwidth"):
            load_settings({"upload_max_bandwidth": bad}, environ={})


def test_few_uploads_measured_keep_the_saved_estimate_and_a_long_upload_gets_a_fallback_save(
    s3: S3Server, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The daemon says how many uploads its estimate rests on; below ten, the estimate the
    checkpoint carried stays a floor. With an upload longer than the margin, the guard makes
    a fallback save one durable save before the final one: it is not the final save (the
    guard follows none), and the final save comes at the budget as before."""
    deadline = time.time() + 3600
    location = s3.bucket("durable-fallback")
    make_checkpoint(tmp_path, 1, {"model.pt": 6 * MIB})
    with serve_daemon(**settings(s3.endpoint, tmp_path, location, deadline,
                                 upload_max_bandwidth=CAP)) as daemon:
        client = SidecarClient(daemon.url, timeout=5)
        wait_for(lambda: client.last_durable_step() == 1, timeout=30)
        body = expiry(daemon.url)
        assert body["upload_measured"] == 1
        upload = body["upload_seconds"]  # about 3.6 s: 6 MiB at 2 MiB/s, x1.2

        carried = upload + 20.0  # what the previous machine's uploader had measured
        clock = Clock(deadline - 1000.0)
        guard = CheckpointGuard(client, SavePolicy(save_seconds=0.1, redundant_seconds=1.0,
                                                   top_up_seconds=None),
                                clock=clock, refresh_seconds=0.0, environ={}, events=False,
                                wait_for_release=False)
        assert guard.load_state_dict({"version": 1, "policy": {},
                                      "upload_seconds": carried})
        for _ in range(40):
            guard.record_step(1.0)  # 40 s trained: over 10 saves (0.1 s) and the lead
        assert guard.should_save() is False  # far: 1000 s left
        decision = guard.last_decision
        assert decision is not None and decision.upload_seconds == pytest.approx(carried)
        budget = 1.0 + 0.1 + carried + 1.0
        assert decision.budget_seconds == pytest.approx(budget)
        assert guard.state_dict()["upload_seconds"] == pytest.approx(carried)

        # Inside (budget + upload, budget + step + save + upload]: the fallback save.
        caplog.set_level(logging.INFO, logger=GUARD_LOGGER)
        clock.now = deadline - (budget + carried + 0.5)
        assert guard.should_save() is True
        decision = guard.last_decision
        assert decision is not None and decision.fallback and not decision.top_up
        assert "fallback save now" in decision.reason
        with guard.saving(step=2):
            make_checkpoint(tmp_path, 2, {"model.pt": 6 * MIB})
        assert guard.status().final_step is None  # a fallback is not the final save
        assert guard.should_stop() is False
        guard.record_step(1.0)
        assert guard.should_save() is False  # 1 s trained since: less than the lead
        clock.now = deadline - budget + 0.5
        assert guard.should_save() is True
        decision = guard.last_decision
        assert decision is not None and not decision.fallback
        with guard.saving(step=3):
            make_checkpoint(tmp_path, 3, {"model.pt": 6 * MIB})
        assert guard.status().final_step == 3
        assert guard.should_stop() is True
        wait_for(lambda: client.last_durable_step() == 3, timeout=30)
        # Step 3's upload counts too (step 2's may have given way to it, unfinished).
        assert expiry(daemon.url)["upload_measured"] >= 2


def drill_messages(caplog: pytest.LogCaptureFixture, committed: Any = None
                   ) -> tuple[list[tuple[int, str]], list[int], Any]:
    """A guard training through a 3 s fire drill on a real daemon (no uploader): the
    guard's log lines, the steps saved, the drill's verdict."""
    caplog.set_level(logging.INFO, logger=GUARD_LOGGER)
    with static_daemon(time.time() + 3600) as daemon:
        guard = CheckpointGuard(SidecarClient(daemon.url),
                                SavePolicy(save_seconds=0.2, redundant_seconds=1.0,
                                           top_up_seconds=None),
                                environ={}, refresh_seconds=0.05)
        saves: list[int] = []
        drill: dict[str, Any] = {}
        limit = time.monotonic() + 30
        step = 0
        while not (drill and verdict(daemon.url, drill["id"])):
            assert time.monotonic() < limit, f"no verdict by step {step}"
            with guard.step():
                time.sleep(0.05)
            if guard.should_save():
                guard.record_save(0.01, step=step, committed=committed)
                saves.append(step)
            assert guard.should_stop() is False
            if not drill and job_heard(daemon.url):
                drill = start_drill(daemon.url, 3.0)
            step += 1
        found = verdict(daemon.url, drill["id"])
    messages = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == GUARD_LOGGER]
    return messages, saves, found


def test_a_drill_s_save_is_logged_as_a_drill_s_not_a_release_s(
    caplog: pytest.LogCaptureFixture,
) -> None:
    messages, saves, found = drill_messages(caplog)
    assert found["verdict"] == "PASS" and len(saves) == 1, (found, saves)
    durable = [m for _, m in messages  # the follower's line, not the drill's report
               if "checkpoint (step" in m and " durable" in m and "fire drill" not in m]
    assert len(durable) == 1 and re.fullmatch(
        rf"drill final checkpoint \(step {saves[0]}\) durable \d+\.\d s before the drill "
        r"deadline \(no uploader: the local save counts\)", durable[0]), durable
    assert not [m for _, m in messages if "release" in m], messages


def test_a_drill_s_save_not_durable_by_its_deadline_is_no_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An asynchronous save never committed: the drill fails, and the guard's own line names
    the drill's deadline, as a warning (nothing was lost), never "NOT ... before the
    release" as an error."""
    messages, saves, found = drill_messages(caplog, committed=lambda: False)
    assert found["verdict"] == "FAIL" and len(saves) == 1, (found, saves)
    assert (logging.WARNING, f"drill final checkpoint (step {saves[0]}) was not durable by "
            "the drill deadline: its asynchronous write had not finished") in messages
    assert not [m for level, m in messages if level >= logging.ERROR or "release" in m], \
        messages
