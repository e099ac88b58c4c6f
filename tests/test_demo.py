"""``esi-sidecar demo`` end to end, shortened: emulator, daemon with its uploader to a volume
folder, trainer, SIGKILL, local disk wiped, restore, resume."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from sidecar.train.checkpoint import latest_valid


def test_demo_saves_in_time_survives_the_kill_and_resumes(tmp_path: Path) -> None:
    workdir = tmp_path / "demo"
    result = subprocess.run(
        [sys.executable, "-m", "sidecar.cli", "demo", "--lead", "20", "--tail", "2",
         "--step-seconds", "0.25", "--poll-interval", "1", "--workdir", str(workdir)],
        capture_output=True, text=True, timeout=180,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "RELEASED: the machine is reclaimed" in out and "its local disk is gone" in out
    assert "brought the checkpoint of step" in out  # restored from the volume
    assert "trainer resumed from step" in out
    assert "0 steps lost" in out
    durable = re.search(r"durable +([0-9.]+) s before the reclaim, on network-volume/", out)
    assert durable is not None and float(durable.group(1)) > 0, out
    total = int((20 + 2) / 0.25)
    found = latest_valid(workdir / "local-disk")
    assert found is not None and found.step == total - 1  # the second run finished
    assert latest_valid(workdir / "network-volume") is not None  # every save went there too
