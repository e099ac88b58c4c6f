"""The fire drill end to end: the daemon uploading to a capped volume, the plain PyTorch
example training against it, and ``esi-sidecar drill --wait`` as a user runs it. The first
drill (default lead) passes and prints its figures, training goes on in the same process
with no step lost; a second drill whose lead is shorter than the measured save + upload
fails with the reason and starts no save; every checkpoint stays intact."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from daemon_harness import get_json, serve_daemon, wait_for

from sidecar.checkpoint.folders import atomic_checkpoint, latest_valid, list_checkpoints
from sidecar.tools.demo.toy_model import build_model
from sidecar.train.client import ENV_URL

ROOT = Path(__file__).resolve().parents[2]
KIB = 1024
CAP = 100 * KIB  # bytes per second to the volume
PADDING = 250 * KIB  # the seeded checkpoint: about 2.5 s to upload at the cap


def cli(*args: str, url: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "sidecar.cli", "drill", "--url", url, *args],
                          capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT)


def test_a_drill_passes_training_goes_on_and_a_too_short_lead_fails(tmp_path: Path) -> None:
    local, volume = tmp_path / "checkpoints", tmp_path / "volume"
    local.mkdir()
    volume.mkdir()
    with atomic_checkpoint(local, 0) as folder:  # where the job resumes from
        build_model(seed=0).save(folder, 0)
        (folder / "padding.bin").write_bytes(os.urandom(PADDING))
    settings = {"sources": ("static",), "expires_at": repr(time.time() + 3600),
                "upload_from": local, "upload_to": volume.as_uri(),
                "upload_scan_interval": 0.2, "upload_max_bandwidth": CAP}
    with serve_daemon(**settings) as daemon:
        wait_for(lambda: get_json(daemon.url + "/v1/expiry")[1]["upload_seconds"], timeout=30)
        env = {**os.environ, ENV_URL: daemon.url, "PYTHONPATH": str(ROOT),
               "OMP_NUM_THREADS": "1"}
        job = subprocess.Popen(
            [sys.executable, str(ROOT / "examples" / "plain_pytorch.py"), "--output",
             str(local), "--steps", "100000000", "--save-seconds", "1",
             "--redundant-seconds", "2", "--top-up-seconds", "off", "--sigterm-grace", "15"],
            env=env, cwd=tmp_path, text=True, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_for(lambda: get_json(daemon.url + "/v1/events?limit=0")[1]["jobs"],
                     timeout=30)
            first = cli("--wait", url=daemon.url)
            assert first.returncode == 0, first.stdout + first.stderr
            assert re.search(r"drill-1: PASS - durable [\d.]+ s before the drill deadline",
                             first.stdout), first.stdout
            figures = re.search(r"step (\d+); budget planned ([\d.]+) s; save ([\d.]+) s, "
                                r"upload ([\d.]+) s, durable ([\d.]+) s", first.stdout)
            assert figures is not None, first.stdout
            drill_step = int(figures.group(1))
            print(first.stdout)  # the figures, for the note
            # A lead shorter than the measured save + upload: FAIL, and no save started.
            # Once drill-1's checkpoint no longer covers it (the rule's own cover: one
            # budget after that save, SavePolicy.covered_seconds), else it is covered.
            one = get_json(daemon.url + "/v1/drill")[1]["drills"][0]
            clear = one["expires_at_unix"] + float(figures.group(2))
            wait_for(lambda: time.time() > clear, timeout=60, interval=0.2)
            before = sorted(p.name for p in local.iterdir())
            second = cli("--in", "1.5", "--wait", url=daemon.url)
            assert second.returncode == 1, second.stdout + second.stderr
            assert "drill-2: FAIL" in second.stdout and "no save started" in second.stdout
            assert "for a save and its upload" in second.stdout, second.stdout
            print(second.stdout)
            assert job.poll() is None  # the same process trains on
            assert sorted(p.name for p in local.iterdir()) == before
            status = subprocess.run(
                [sys.executable, "-m", "sidecar.cli", "status", "--url", daemon.url],
                capture_output=True, text=True, env=env, timeout=30, cwd=ROOT)
            assert "last drill: drill-2 FAIL" in status.stdout, status.stdout
            # The job's end: SIGTERM (its guard saves once more and exits 75).
            os.killpg(job.pid, signal.SIGTERM)
            output, _ = job.communicate(timeout=60)
        finally:
            if job.poll() is None:
                os.killpg(job.pid, signal.SIGKILL)
                job.communicate()
        assert job.returncode == 75, output[-3000:]
        assert output.count("training steps ") == 1, output[-3000:]  # no restart
        stopped = re.search(r"stopping at step (\d+)", output)
        assert stopped is not None and int(stopped.group(1)) > drill_step, output[-3000:]
        assert "fire drill drill-1: checkpoint (step" in output
        wait_for(lambda: get_json(daemon.url + "/v1/uploads")[1]["last_durable_step"]
                 == int(stopped.group(1)), timeout=30)
    # Every checkpoint intact, here and on the volume: the seed, the drill's, the last.
    steps = sorted(c.info.step for c in list_checkpoints(local) if c.info is not None)
    assert steps == [0, drill_step, int(stopped.group(1))]
    on_volume = sorted(c.info.step for c in list_checkpoints(volume) if c.info is not None)
    assert on_volume == steps
    newest = latest_valid(volume, verify_checksums=True)
    assert newest is not None and newest.step == int(stopped.group(1))


def test_a_drill_against_a_daemon_with_no_job_exits_3_with_one_line() -> None:
    with serve_daemon(sources=("static",), expires_at=repr(time.time() + 3600)) as daemon:
        result = cli("--wait", url=daemon.url, timeout=30)
    assert result.returncode == 3, result.stdout + result.stderr
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    assert len(lines) == 1 and "no job answers this daemon" in lines[0], lines
