"""The checkpoint waits for the job, in the real daemon, and the time to resume closes the
reclaim's account (issue 40, items 2 and 3): the daemon's follower brings the volume's
newest checkpoint before any job, the uploader finds it durable without sending it, a
restore finds it in place, and the account closes at the job's first step with the
follower's copy as its restore."""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from daemon_harness import get_json, serve_daemon, wait_for
from upload_support import MIB, make_checkpoint

from sidecar.checkpoint.folders import latest_valid
from sidecar.host.features.reclaims.ledger import ReclaimLedger
from sidecar.host.upload.fetch import restore_newest
from sidecar.train.reclaim_cost import effective_ratio, release_cost, with_resume

STATIC = {"sources": ("static",), "expires_at": "2030-01-01T00:00:00Z"}


def post(url: str, path: str, body: object) -> tuple[int, Any]:
    request = urllib.request.Request(url + path, method="POST", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return int(response.status), json.loads(response.read())
    except urllib.error.HTTPError as exc:
        with exc:
            return int(exc.code), json.loads(exc.read() or b"{}")


def test_the_next_machines_daemon_brings_the_checkpoint_and_closes_the_time_to_resume(
        tmp_path: Path) -> None:
    volume, local = tmp_path / "volume", tmp_path / "local"
    volume.mkdir()
    local.mkdir()
    os.chown(local, 4321, 4321)
    remote = make_checkpoint(volume, 300, {f"part-{i}": MIB for i in range(4)})
    released = time.time() - 60  # the previous machine went a minute ago
    with serve_daemon(upload_from=local, upload_to=volume.as_uri(), **STATIC) as daemon:
        wait_for(lambda: (local / remote.name).is_dir(), timeout=30)
        info = latest_valid(local, verify_checksums=True)
        assert info is not None and info.step == 300
        # The uploader sees the same manifest at the destination: durable, nothing sent.
        upload = wait_for(lambda: next((r for r in get_json(daemon.url + "/v1/uploads")[1]
                                        ["checkpoints"] if r["state"] == "done"), None))
        assert upload["name"] == remote.name and "already complete" in upload["note"]
        assert {n for n in os.listdir(volume) if not n.startswith(".esi-sidecar")} == {
            remote.name, "latest"}  # nothing new on the volume (its identity marker aside)
        # The job's launcher (esi-sidecar run --restore-from) finds it in place.
        restored = restore_newest(volume.as_uri(), local, {})
        assert restored.already_present and restored.seconds < 1.0
        status, body = post(daemon.url, "/v1/reclaims", {
            "released_unix": released, "state_unix": released - 30, "resumed_step": 300,
            "checkpoint": remote.name, "restore_started_unix": time.time(),
            "restore_finished_unix": time.time()})
        assert status == 201, body
        assert get_json(daemon.url + "/v1/reclaims")[1]["reclaims"][0]["resume_seconds"] is None
        first_step = time.time()
        status, _ = post(daemon.url, "/v1/events", {"kind": "step-estimate", "job": "next",
                                                     "at_unix": first_step,
                                                     "step_seconds": 1.0})
        assert status == 202
        account = wait_for(lambda: get_json(daemon.url + "/v1/reclaims")[1]["reclaims"][0]
                           if get_json(daemon.url + "/v1/reclaims")[1]["reclaims"][0]
                           ["resume_seconds"] is not None else None)
        metrics = urllib.request.urlopen(daemon.url + "/metrics", timeout=5).read().decode()
        page = urllib.request.urlopen(daemon.url + "/", timeout=5).read().decode()
    brought = daemon.daemon.follower.brought[0]
    assert account["resume_seconds"] == first_step - released
    assert account["restore_seconds"] == brought.finished_unix - brought.started_unix
    assert account["waiting_seconds"] == brought.started_unix - released
    assert account["startup_seconds"] == first_step - brought.finished_unix
    assert "esi_sidecar_release_resume_seconds_count 1.0" in metrics
    assert "training again" in page


def test_prefetch_false_starts_no_follower(tmp_path: Path) -> None:
    with serve_daemon(upload_from=tmp_path, upload_to=tmp_path.as_uri(), upload_prefetch=False,
                      **STATIC) as daemon:
        assert daemon.daemon.follower is None and daemon.daemon.uploader is not None


def test_the_effective_ratio_counts_the_time_to_resume() -> None:
    cost = release_cost(released_unix=1000.0, state_unix=900.0, resumed_step=1,
                        started_unix=0.0)
    assert effective_ratio([cost]) == 0.9
    resumed = with_resume(cost, restore_started_unix=1050.0, restore_finished_unix=1060.0,
                          resumed_unix=1100.0)
    assert resumed.resume_split() == {"waiting": 50.0, "restore": 10.0, "startup": 40.0}
    assert effective_ratio([resumed]) == 900.0 / 1100.0


def test_the_time_to_resume_survives_a_restart() -> None:
    ledger = ReclaimLedger()
    cost = with_resume(release_cost(released_unix=1000.0, state_unix=900.0, resumed_step=1,
                                    closed_by="restore"),
                       restore_started_unix=1001.0, restore_finished_unix=1002.0,
                       resumed_unix=1030.0)
    ledger.record(cost, "restore from 127.0.0.1")
    again = ReclaimLedger()
    again.load(json.loads(json.dumps(ledger.dump())))
    assert again.body()["reclaims"][0]["resume_seconds"] == 30.0
