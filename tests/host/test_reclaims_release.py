"""What a release cost, end to end (issue 24, item 3): the daemon with its uploader to a
volume, a real guard training and saving with atomic_checkpoint until a release 8 s away,
then `esi-sidecar restore --released-at` on the "next machine". The GPU time it reports
matches the simulator's accounting of the same timeline within a second. In the
integration tier (tests/conftest.py): it waits for a real release."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from daemon_harness import get_json, serve_daemon, wait_for
from guard_support import closed_port

from sidecar.checkpoint.folders import atomic_checkpoint
from sidecar.timeparse import format_rfc3339
from sidecar.train.client import SidecarClient
from sidecar.train.guard import CheckpointGuard
from sidecar.train.policy import SavePolicy
from sidecar.train.reclaim_cost import lost_seconds


def train_until_the_release(url: str, root: Path) -> int:
    guard = CheckpointGuard(SidecarClient(url, timeout=2),
                            SavePolicy(save_seconds=0.5, redundant_seconds=3.0),
                            refresh_seconds=0.1, environ={})
    step = 0
    try:
        while step < 10_000:
            with guard.step():
                time.sleep(0.05)
            step += 1
            if guard.should_save():
                with guard.saving(step=step), atomic_checkpoint(root, step) as folder:
                    (folder / "model.bin").write_bytes(b"x" * 4096)
            if guard.should_stop():
                assert guard.released
                return step
    finally:
        guard.client.close()
    raise AssertionError("the release never came")


def test_restore_reports_the_gpu_time_the_release_cost_as_the_simulator_counts_it(
        tmp_path: Path) -> None:
    checkpoints, volume, fresh = tmp_path / "ckpt", tmp_path / "volume", tmp_path / "next"
    checkpoints.mkdir()
    volume.mkdir()
    release = time.time() + 8.0
    with serve_daemon(sources=("static",), expires_at=format_rfc3339(release),
                      upload_from=checkpoints, upload_to=volume.as_uri(),
                      upload_scan_interval=0.2, poll_interval=0.2) as daemon:
        train_until_the_release(daemon.url, checkpoints)
        _, body = wait_for(lambda: (r := get_json(daemon.url + "/v1/reclaims"))[1]["count"]
                           and r, timeout=20)
        events = list(reversed(get_json(daemon.url + "/v1/events?limit=500")[1]["events"]))
        metrics = urllib.request.urlopen(daemon.url + "/metrics", timeout=5).read().decode()
        page = urllib.request.urlopen(daemon.url + "/", timeout=5).read().decode()
    account = body["reclaims"][0]

    # The simulator's accounting of the same timeline: from the start of the save of the
    # newest durable checkpoint to the release.
    durable_step = [e for e in events if e["kind"] == "durable"][-1]["step"]
    state = next(e["at_unix"] for e in events
                 if e["kind"] == "save-started" and e.get("step") == durable_step)
    simulated = lost_seconds(release, state)
    assert account["resumed_step"] == durable_step
    assert abs(account["lost_seconds"] - simulated) < 1.0
    assert account["saves"] >= 1 and account["idle_seconds"] > 0
    assert account["redone_seconds"] <= account["lost_seconds"]
    assert body["effective_ratio"] is not None and 0 < body["effective_ratio"] < 1

    restored = subprocess.run(
        [sys.executable, "-m", "sidecar.cli", "restore", "--from", volume.as_uri(), "--to",
         str(fresh), "--released-at", format_rfc3339(release), "--url", f"http://127.0.0.1:{closed_port()}"],
        capture_output=True, text=True, timeout=60)
    assert restored.returncode == 0, restored.stderr
    line = restored.stdout.splitlines()[-1]
    assert line.startswith("the release cost ") and f"step {durable_step} " in line, line
    reported = float(line.split("the release cost ")[1].split(" s ")[0])
    assert abs(reported - simulated) < 1.0, (reported, simulated)

    assert "esi_sidecar_reclaims_total 1.0" in metrics
    assert 'esi_sidecar_release_lost_seconds_bucket{le="+Inf"} 1.0' in metrics
    assert '<svg id="reclaims"' in page
