"""``esi-sidecar demo`` end to end, shortened: emulator, daemon, trainer, SIGKILL, resume."""

from __future__ import annotations

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
    assert "RELEASED: the machine is reclaimed" in out
    assert "trainer resumed from step" in out
    assert "0 steps lost" in out
    assert "before the reclaim" in out
    total = int((20 + 2) / 0.25)
    found = latest_valid(workdir / "checkpoints")
    assert found is not None and found.step == total - 1  # the second run finished
