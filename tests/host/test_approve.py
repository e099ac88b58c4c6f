"""--azure-approve: the daemon approves a pending Azure scheduled event (StartRequests)
once a checkpoint saved after the event was announced is durable, never before, and
never without an uploader. The real daemon, the Azure IMDS fake, a volume as storage."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest
from daemon_harness import get_json, serve_daemon, wait_for

from sidecar.checkpoint.folders import atomic_checkpoint
from sidecar.tools.emulator.azure import AzureImdsEmulator
from sidecar.train.client import SidecarClient


def save(root: Path, step: int) -> None:
    with atomic_checkpoint(root, step) as folder:
        (folder / "model.pt").write_bytes(os.urandom(64 * 1024))


def test_an_event_is_approved_once_a_checkpoint_saved_after_it_is_durable(
        tmp_path: Path) -> None:
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
        time.sleep(2.5)  # two approver rounds: the old checkpoint is not enough
        assert azure.approved == []
        save(local, 2)
        wait_for(lambda: azure.approved == [event], timeout=30)
        assert client.last_durable_step() == 2
        # Approved: Azure starts the event; its deadline is now (first seen started).
        wait_for(lambda: (get_json(daemon.url + "/v1/expiry")[1]["remaining_seconds"] or 99)
                 < 5, timeout=10)


def test_without_an_uploader_nothing_is_approved_and_it_is_said_once(
        caplog: pytest.LogCaptureFixture) -> None:
    with AzureImdsEmulator() as azure, caplog.at_level(logging.WARNING, "sidecar.host.approve"), \
            serve_daemon(sources=("azure",), azure_metadata_url=azure.url,
                         azure_approve=True) as daemon:
        azure.schedule("Preempt", 60)
        wait_for(lambda: get_json(daemon.url + "/v1/expiry")[1]["kind"] == "preemption-notice")
        wait_for(lambda: any("needs the uploader" in r.getMessage() for r in caplog.records))
        time.sleep(2.5)
    assert azure.approved == []
    said = [r for r in caplog.records if "needs the uploader" in r.getMessage()]
    assert len(said) == 1


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
        assert daemon.daemon.approver is None
        time.sleep(1.5)
    assert azure.approved == []
