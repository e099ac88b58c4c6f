"""``esi-sidecar demo`` end to end, shortened: emulator, daemon with its uploader to a volume
folder, trainer, SIGKILL, local disk wiped, restore, resume."""

from __future__ import annotations

import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from sidecar.checkpoint.folders import latest_valid

# Seconds from the emulator's start to the release: the trainer (torch imported) must start
# and save before it. 20 s was enough alone; beside other tests on 2 cores a trainer took
# more than 15 s to start.
LEAD_SECONDS = 45


def test_demo_saves_in_time_survives_the_kill_and_resumes(tmp_path: Path) -> None:
    workdir = tmp_path / "demo"
    process = subprocess.Popen(
        [sys.executable, "-m", "sidecar.cli", "demo", "--lead", str(LEAD_SECONDS), "--tail", "2",
         "--step-seconds", "0.25", "--poll-interval", "1", "--workdir", str(workdir)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    lines, page = [], ""
    try:
        assert process.stdout is not None
        for line in process.stdout:  # while the demo runs: the page it points to answers
            lines.append(line)
            found = re.search(r"watch it live: open (http://127\.0\.0\.1:\d+/) in a browser",
                              line)
            if found and not page:
                with urllib.request.urlopen(found.group(1), timeout=5) as response:
                    page = response.read().decode()
        _, errors = process.communicate(timeout=180)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    out = "".join(lines)
    assert process.returncode == 0, out + errors
    assert 'id="countdown"' in page and "Release in" in page, page[:2000]
    assert "RELEASED: the machine is reclaimed" in out and "its local disk is gone" in out
    # The next machine's daemon put the checkpoint in place during the "image pull", and
    # the job's own restore found it there (issue 40).
    assert re.search(r"checkpoint of step \d+ waiting on the local disk", out), out
    assert "the job's esi-sidecar restore found it in place: step" in out, out
    assert re.search(r"time to resume +training again [0-9.]+ s after the release", out), out
    assert "trainer resumed from step" in out
    assert "0 steps lost" in out
    durable = re.search(r"durable +([0-9.]+) s before the reclaim, on network-volume/", out)
    assert durable is not None and float(durable.group(1)) > 0, out
    total = int((LEAD_SECONDS + 2) / 0.25)
    found = latest_valid(workdir / "local-disk")
    assert found is not None and found.step == total - 1  # the second run finished
    assert latest_valid(workdir / "network-volume") is not None  # every save went there too
    # The wipe takes the disk at once: the uploader never sees a half-deleted checkpoint
    # (issue 39: "not uploading step_...: file guard.json listed in the manifest is missing").
    log = (workdir / "daemon.log").read_text()
    assert "listed in the manifest is missing" not in log, log


def test_the_local_disk_goes_at_once_never_file_by_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The demo's reclaim: ``local-disk`` is gone before any file in it is deleted, so the
    daemon's uploader, rescanning it, finds the whole folder or nothing."""
    import shutil

    from sidecar.checkpoint.folders import atomic_checkpoint
    from sidecar.tools.demo import run

    local = tmp_path / "local-disk"
    with atomic_checkpoint(local, 3) as folder:
        (folder / "guard.json").write_text("{}")
    seen: list[bool] = []
    real_rmtree = shutil.rmtree

    def watched_rmtree(path: Path, *args: object, **kwargs: object) -> None:
        seen.append(local.exists())  # the folder the uploader watches, as deletion starts
        real_rmtree(path)

    monkeypatch.setattr(run.shutil, "rmtree", watched_rmtree)
    run.wipe_local_disk(local)
    assert seen == [False] and not local.exists()
    assert list(tmp_path.iterdir()) == []
