"""--azure-approve: the daemon approves a pending Azure scheduled event (StartRequests)
once a checkpoint saved after the event was announced is durable, never before, and
never without an uploader. The real daemon, the Azure IMDS fake, a volume as storage."""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
from daemon_harness import RunningDaemon, get_json, serve_daemon, wait_for

from sidecar.checkpoint.folders import atomic_checkpoint
from sidecar.checkpoint.manifest import MANIFEST_NAME
from sidecar.host.approve import Approver
from sidecar.host.sources.base import SourceError
from sidecar.timeparse import format_rfc3339
from sidecar.tools.emulator.azure import AzureImdsEmulator
from sidecar.train.client import SidecarClient

AN_HOUR_AHEAD = 3600.0


def save(root: Path, step: int) -> None:
    with atomic_checkpoint(root, step) as folder:
        (folder / "model.pt").write_bytes(os.urandom(64 * 1024))


def save_dated_ahead(root: Path, step: int) -> None:
    """A checkpoint whose manifest says it was made an hour from now (a writer whose
    clock runs ahead), appearing in ``root`` at once, as a commit's rename does."""
    staging = root.parent / "staging"
    staging.mkdir(exist_ok=True)
    saving = atomic_checkpoint(staging, step)
    with saving as folder:
        (folder / "model.pt").write_bytes(os.urandom(64 * 1024))
    committed = staging / saving.name
    manifest = committed / MANIFEST_NAME
    body = json.loads(manifest.read_text(encoding="utf-8"))
    body["created_at"] = format_rfc3339(time.time() + AN_HOUR_AHEAD)
    manifest.write_text(json.dumps(body), encoding="utf-8")
    os.rename(committed, root / saving.name)


def two_rounds(daemon: RunningDaemon) -> None:
    """Wait (bounded) until the approver has completed two rounds from now: the first may
    have begun before the event was pending, the second began after it was."""
    approver = daemon.daemon.approver
    assert approver is not None
    start = approver.rounds
    wait_for(lambda: approver.rounds >= start + 2, timeout=30)


def test_an_event_is_approved_once_a_checkpoint_saved_after_it_is_durable(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "sidecar.host.approve")
    local, volume = tmp_path / "local", tmp_path / "volume"
    local.mkdir()
    volume.mkdir()
    save(local, 1)  # before the event: it must not count
    with AzureImdsEmulator() as azure, serve_daemon(
            sources=("azure",), azure_metadata_url=azure.url, azure_approve=True,
            upload_from=local, upload_to=volume.as_uri(), upload_scan_interval=0.2) as daemon:
        client = SidecarClient(daemon.url, timeout=5)
        wait_for(lambda: client.last_durable_step() == 1, timeout=30)
        event = azure.schedule("Preempt", 60)
        wait_for(lambda: get_json(daemon.url + "/v1/expiry")[1]["kind"] == "preemption-notice")
        two_rounds(daemon)  # the old checkpoint is not enough
        assert azure.approved == []
        save(local, 2)
        wait_for(lambda: azure.approved == [event], timeout=30)
        assert client.last_durable_step() == 2
        two_rounds(daemon)  # the approver goes on after an approval
        assert [r.getMessage() for r in caplog.records if "approved" in r.getMessage()] == [
            f"azure: approved {event}: a checkpoint saved after the notice is durable"]
        # Approved: Azure starts the event; its deadline is now (first seen started).
        wait_for(lambda: (get_json(daemon.url + "/v1/expiry")[1]["remaining_seconds"] or 99)
                 < 5, timeout=10)


def test_an_approval_the_service_refuses_is_said_and_tried_again_next_round(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "sidecar.host.approve")
    local, volume = tmp_path / "local", tmp_path / "volume"
    local.mkdir()
    volume.mkdir()
    with AzureImdsEmulator() as azure, serve_daemon(
            sources=("azure",), azure_metadata_url=azure.url, azure_approve=True,
            upload_from=local, upload_to=volume.as_uri(), upload_scan_interval=0.2):
        azure.refuse_approvals(1)
        # Two events pending at once (a Freeze and a Preempt): approved together.
        events = [azure.schedule("Freeze", 60), azure.schedule("Preempt", 60)]

        def seen(event: str) -> bool:  # the source logs each event when it first sees it
            return any(event in r.getMessage() for r in caplog.records
                       if r.name == "sidecar.host.sources.azure")

        wait_for(lambda: all(seen(event) for event in events))
        save(local, 1)  # after the events: the first approval is refused, the next one holds
        wait_for(lambda: sorted(azure.approved) == sorted(events), timeout=30)
    said = [r.getMessage() for r in caplog.records
            if r.name == "sidecar.host.approve" and "approv" in r.getMessage()]
    assert len(said) == 2, said
    named = said[0].split(": approving ", 1)[1].split(" failed: ", 1)[0]
    assert sorted(named.split(", ")) == sorted(events), said
    assert said[0].startswith("azure: approving "), said
    assert "approval: HTTP 500 from http://127.0.0.1:" in said[0], said
    assert said[0].endswith(": Internal server error"), said
    approved = said[1].split("azure: approved ", 1)[1].split(": a checkpoint", 1)[0]
    assert sorted(approved.split(", ")) == sorted(events), said
    assert said[1].endswith(": a checkpoint saved after the notice is durable"), said


def test_a_checkpoint_dated_ahead_but_saved_before_the_event_is_not_enough(
        tmp_path: Path) -> None:
    """Issue 22, item 5: approval reads what the daemon saw, not the manifest's time."""
    local, volume = tmp_path / "local", tmp_path / "volume"
    local.mkdir()
    volume.mkdir()
    with AzureImdsEmulator() as azure, serve_daemon(
            sources=("azure",), azure_metadata_url=azure.url, azure_approve=True,
            upload_from=local, upload_to=volume.as_uri(), upload_scan_interval=0.2) as daemon:
        client = SidecarClient(daemon.url, timeout=5)
        save_dated_ahead(local, 1)  # seen appearing by this daemon, before the event
        wait_for(lambda: client.last_durable_step() == 1, timeout=30)
        event = azure.schedule("Preempt", 60)
        wait_for(lambda: get_json(daemon.url + "/v1/expiry")[1]["kind"] == "preemption-notice")
        two_rounds(daemon)  # a time written by the job is not enough
        assert azure.approved == []
        save(local, 2)  # appears after the event, becomes durable: now it is safe
        wait_for(lambda: azure.approved == [event], timeout=30)
        assert client.last_durable_step() == 2


def test_after_a_restart_the_checkpoints_already_there_are_older_than_any_event(
        tmp_path: Path) -> None:
    local, volume = tmp_path / "local", tmp_path / "volume"
    local.mkdir()
    volume.mkdir()
    settings = dict(sources=("azure",), azure_approve=True, upload_from=local,
                    upload_to=volume.as_uri(), upload_scan_interval=0.2)
    with AzureImdsEmulator() as azure:
        with serve_daemon(azure_metadata_url=azure.url, **settings) as daemon:
            save_dated_ahead(local, 1)
            wait_for(lambda: SidecarClient(daemon.url).last_durable_step() == 1, timeout=30)
        with serve_daemon(azure_metadata_url=azure.url, **settings) as daemon:
            client = SidecarClient(daemon.url, timeout=5)
            wait_for(lambda: client.last_durable_step() == 1, timeout=30)  # found in storage
            event = azure.schedule("Preempt", 60)
            wait_for(lambda: get_json(daemon.url + "/v1/expiry")[1]["kind"]
                     == "preemption-notice")
            two_rounds(daemon)  # what was there at start is not enough
            assert azure.approved == []
            save(local, 2)
            wait_for(lambda: azure.approved == [event], timeout=30)


def test_without_an_uploader_nothing_is_approved_and_it_is_said_once(
        caplog: pytest.LogCaptureFixture) -> None:
    with AzureImdsEmulator() as azure, caplog.at_level(logging.WARNING, "sidecar.host.approve"), \
            serve_daemon(sources=("azure",), azure_metadata_url=azure.url,
                         azure_approve=True) as daemon:
        event = azure.schedule("Preempt", 60)
        wait_for(lambda: get_json(daemon.url + "/v1/expiry")[1]["kind"] == "preemption-notice")
        wait_for(lambda: any("needs the uploader" in r.getMessage() for r in caplog.records))
        two_rounds(daemon)  # and said no more
    assert azure.approved == []
    said = [r.getMessage() for r in caplog.records if "needs the uploader" in r.getMessage()]
    assert said == [f"azure: not approving {event}: approval needs the uploader (--upload-to), "
                    "a local checkpoint dies with the VM"]


def test_approval_is_off_unless_asked(tmp_path: Path) -> None:
    local, volume = tmp_path / "local", tmp_path / "volume"
    local.mkdir()
    volume.mkdir()
    with AzureImdsEmulator() as azure, serve_daemon(
            sources=("azure",), azure_metadata_url=azure.url,
            upload_from=local, upload_to=volume.as_uri(), upload_scan_interval=0.2) as daemon:
        azure.schedule("Preempt", 60)
        wait_for(lambda: get_json(daemon.url + "/v1/expiry")[1]["kind"] == "preemption-notice")
        save(local, 1)
        wait_for(lambda: SidecarClient(daemon.url).last_durable_step() == 1, timeout=30)
        assert daemon.daemon.approver is None  # no rounds to wait for: none can approve
    assert azure.approved == []


# ------------------------------------------------------------ one round, several sources
# The daemon runs one approvable source per platform; these pin the round itself over
# several at once (the Approvable protocol, the platform's side recorded), so that one
# source with nothing to do, one not ready yet or one whose service refuses never keeps
# another's events from being approved.


class Platform:
    """An approvable source: its pending events, what it was asked to approve, and a
    refusal of the service (as the Azure emulator's ``refuse_approvals``)."""

    approve_enabled = True

    def __init__(self, name: str, pending: list[tuple[str, float, str]],
                 refuse: bool = False) -> None:
        self.name, self._pending, self.refuse = name, pending, refuse
        self.asked: list[list[str]] = []

    def pending(self) -> list[tuple[str, float, str]]:
        return list(self._pending)

    def approve(self, event_ids: Sequence[str]) -> None:
        self.asked.append(list(event_ids))
        if self.refuse:
            raise SourceError("500 Internal Server Error")
        self._pending = [p for p in self._pending if p[0] not in event_ids]


def test_a_round_goes_on_past_a_source_with_nothing_pending_one_not_ready_and_one_refused(
        caplog: pytest.LogCaptureFixture) -> None:
    idle = Platform("idle", [])
    early = Platform("early", [("e-1", 200.0, "Preempt")])  # seen after the checkpoint
    refused = Platform("refused", [("r-1", 50.0, "Preempt"), ("r-2", 60.0, "Freeze")],
                       refuse=True)
    ready = Platform("ready", [("a-1", 100.0, "Preempt"), ("a-2", 90.0, "Reboot")])
    approver = Approver(lambda: [idle, early, refused, ready], lambda: 100.0)
    with caplog.at_level(logging.INFO, "sidecar.host.approve"):
        assert approver.check_once() == ["a-1", "a-2"]
    # Seen at the very instant the checkpoint's appearance was bounded (100.0): it
    # appeared after the event, so it counts.
    assert ready.asked == [["a-1", "a-2"]] and early.asked == []
    assert refused.asked == [["r-1", "r-2"]]
    assert [r.getMessage() for r in caplog.records] == [
        "refused: approving r-1, r-2 failed: 500 Internal Server Error",
        "ready: approved a-1, a-2: a checkpoint saved after the notice is durable"]
    assert approver.rounds == 1


def test_without_an_uploader_every_pending_event_is_named_once_and_none_approved(
        caplog: pytest.LogCaptureFixture) -> None:
    first = Platform("azure", [("a-1", 10.0, "Preempt"), ("a-2", 11.0, "Freeze")])
    approver = Approver(lambda: [first], None)
    with caplog.at_level(logging.WARNING, "sidecar.host.approve"):
        assert approver.check_once() == [] and approver.check_once() == []
    assert first.asked == []
    assert [r.getMessage() for r in caplog.records] == [
        "azure: not approving a-1, a-2: approval needs the uploader (--upload-to), "
        "a local checkpoint dies with the VM"]
