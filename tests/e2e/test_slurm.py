"""A real Slurm job protected by the guard, without a daemon: ``sbatch --time=3`` running
examples/plain_pytorch.py saves before the time limit, resumes in the same process after
``scontrol update TimeLimit=+5`` (a renewal), then saves and exits 75 on a
preemption-style SIGTERM (``scancel --signal=TERM``), every checkpoint complete.

The guard reads the job's end itself (sidecar/train/slurm_deadline.py: squeue at most
once a minute), so its margin is set above that minute: an extension granted after the
final save is then seen before the old limit passes. The partition's GraceTime (20 s)
is shorter than --sigterm-grace (25 s) and becomes the SIGTERM deadline. The job's name
forges a far end in ``scontrol show job -o`` (``EndTime=2099-...`` before the real one):
the guard reads the fixed ``squeue`` format, so it saves before the real limit all the same.
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path

import pytest
from daemon_harness import wait_for
from slurm_cluster import SlurmCluster, missing_tools, running_cluster

from sidecar import EXIT_RELEASED
from sidecar.checkpoint.folders import list_checkpoints, validate
from sidecar.train.client import ENV_URL
from sidecar.train.slurm_deadline import ASK_SECONDS

REPO = Path(__file__).resolve().parents[2]
GRACE_SECONDS = 20
# Above one ask interval (plus the step, the save and a busy host's slack): the final save
# comes that long before the limit, and the extension made after it is read before it.
REDUNDANT_SECONDS = ASK_SECONDS + 15
FORGED_NAME = "train EndTime=2099-12-31T00:00:00"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(bool(missing_tools()),
                       reason=f"needs Debian's {', '.join(missing_tools())}"),
]


@pytest.fixture(scope="module")
def cluster() -> Iterator[SlurmCluster]:
    with running_cluster(grace_seconds=GRACE_SECONDS, kill_wait_seconds=30) as started:
        yield started


def end_time(cluster: SlurmCluster, job: str) -> str:
    """The job's real EndTime (``scontrol show job``'s first one is the name's forgery)."""
    return cluster.run("squeue", "-h", "-j", job, "-o", "%e").stdout.strip()


def output_of(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def wait_in_log(path: Path, pattern: str, *, after: int = 0, timeout: float) -> re.Match[str]:
    """The first match of ``pattern`` in the job's output past offset ``after``."""
    found = wait_for(lambda: re.compile(pattern).search(output_of(path), after),
                     timeout=timeout, interval=0.2)
    assert found, f"no {pattern!r} in the job's output:\n{output_of(path)}"
    return found


def test_a_time_limited_job_saves_resumes_on_extension_and_saves_on_sigterm(
    cluster: SlurmCluster, tmp_path: Path, unused_port: int
) -> None:
    output = tmp_path / "checkpoints"
    log = tmp_path / "job.out"
    command = [sys.executable, str(REPO / "examples" / "plain_pytorch.py"),
               "--steps", "100000000", "--output", str(output), "--save-seconds", "1",
               "--redundant-seconds", str(REDUNDANT_SECONDS), "--top-up-seconds", "off",
               "--sigterm-grace", "25"]
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO),
                                                       os.environ.get("PYTHONPATH")])),
           ENV_URL: f"http://127.0.0.1:{unused_port}"}  # no daemon answers
    submitted = time.monotonic()
    job = cluster.submit(f"cd {REPO}\nexec {' '.join(command)}\n", "--time=3", "-o", str(log),
                         f"--job-name={FORGED_NAME}", env=env)
    cluster.wait_job(job, ("RUNNING",), 30)
    first_end = end_time(cluster, job)
    assert first_end < "2099" and cluster.job(job)["EndTime"] == "2099-12-31T00:00:00"

    # 1. The final save comes before the time limit, from the job's own reading of it.
    wait_in_log(log, rf"Slurm job {job} ends at", timeout=60)
    saved = wait_in_log(log, r"final checkpoint saved; waiting for the release", timeout=200)
    assert cluster.job(job)["JobState"] == "RUNNING" and end_time(cluster, job) == first_end
    first = [c for c in list_checkpoints(output, verify_checksums=True)]
    assert first and all(c.valid for c in first), first

    # 2. An extension is a renewal: the same process trains on.
    extended = time.monotonic()
    cluster.run("scontrol", "update", f"JobId={job}", "TimeLimit=+5")
    wait_in_log(log, r"the release moved later .*training resumes", after=saved.end(),
                timeout=ASK_SECONDS + 20)
    seen_after = time.monotonic() - extended
    assert cluster.job(job)["TimeLimit"] == "00:08:00"

    # 3. Preemption-style SIGTERM: save at once, leave with EXIT_RELEASED before GraceTime.
    # Sent once the SIGTERM's deadline lies past the old limit by the rule's re-arm margin
    # (redundant_seconds): nearer, the save rule counts the final save made for the old
    # limit as this deadline's too, and leaves without a new one (SavePolicy's re-arm).
    wait_in_log(log, r"SIGTERM deadline: the partition's GraceTime, 20 s", timeout=10)
    old_end = datetime.strptime(first_end, "%Y-%m-%dT%H:%M:%S").replace(tzinfo=timezone.utc)
    term_after = old_end.timestamp() + REDUNDANT_SECONDS - GRACE_SECONDS + 5
    wait_for(lambda: time.time() > term_after, timeout=200, interval=0.2)
    resumed_at = len(output_of(log))
    cluster.run("scancel", "--batch", "--signal=TERM", job)
    done = cluster.wait_job(job, ("FAILED", "COMPLETED", "CANCELLED", "TIMEOUT"), 60)
    text = output_of(log)
    assert done["ExitCode"] == f"{EXIT_RELEASED}:0", text
    after = text[resumed_at:]
    assert "SIGTERM received" in after and "checkpoint now" in after, after
    listing = list_checkpoints(output, verify_checksums=True)
    assert all(c.valid for c in listing), listing  # never killed mid-save
    newest = max(c.step for c in listing if c.step is not None)
    assert newest > max(c.step for c in first if c.step is not None)  # trained after the renewal
    validate(next(c.path for c in listing if c.step == newest), verify_checksums=True)
    print(f"job {job}: extension seen by the guard {seen_after:.1f} s after scontrol update; "
          f"whole job {time.monotonic() - submitted:.0f} s")
