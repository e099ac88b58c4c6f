"""A job that ends without a release says so (issue 39, item 4): the guard's ``finished``
event at the interpreter's exit, the daemon no longer counting the job as running, and
``esi-sidecar drill --wait`` answering "no job is running" at once (exit 3) instead of
waiting minutes for a verdict that cannot come; against the real daemon."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from daemon_harness import get_json, serve_daemon, wait_for

from sidecar.cli.drill import EXIT_NO_ANSWER, progress_line
from sidecar.train.daemon_request import unreachable_reason

ROOT = Path(__file__).resolve().parents[2]

# A plain loop of a few steps that ends on its own (the release is an hour away).
JOB = """
from sidecar import CheckpointGuard
guard = CheckpointGuard(job="finishes:1")
for step in range(5):
    with guard.step():
        pass
    if guard.should_save():
        raise SystemExit("no save expected")
    if guard.should_stop():
        raise SystemExit("no stop expected")
guard.exit_if_released()  # returns: it never stopped
"""


def run(args: list[str], url: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "ESI_SIDECAR_URL": url}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=ROOT)


def test_a_job_that_ended_is_not_running_and_a_drill_says_so_at_once() -> None:
    with serve_daemon(sources=("static",), expires_at=repr(time.time() + 3600)) as daemon:
        job = run(["-c", JOB], daemon.url)
        assert job.returncode == 0, job.stdout + job.stderr
        jobs = wait_for(lambda: get_json(daemon.url + "/v1/events")[1]["jobs"], timeout=10)
        assert [(j["job"], j["state"]) for j in jobs] == [("finishes:1", "finished")], jobs
        finished = get_json(daemon.url + "/v1/events")[1]["events"][0]
        assert finished["kind"] == "finished", finished
        assert finished["reason"] == "the process exited", finished

        started = time.monotonic()
        drill = run(["-m", "sidecar.cli", "drill", "--wait"], daemon.url)
        took = time.monotonic() - started
    assert drill.returncode == EXIT_NO_ANSWER, drill.stdout + drill.stderr
    assert took < 5, took
    lines = [line for line in (drill.stdout + drill.stderr).splitlines() if line.strip()]
    assert len(lines) == 1 and "no job is running" in lines[0], lines


def test_a_drill_against_a_dead_daemon_says_so_in_one_clean_line() -> None:
    with socket.socket() as closed:  # bound, never listening: a connect is refused
        closed.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{closed.getsockname()[1]}"
        drill = run(["-m", "sidecar.cli", "drill", "--wait"], url)
    assert drill.returncode == 4, drill.stdout + drill.stderr
    lines = [line for line in (drill.stdout + drill.stderr).splitlines() if line.strip()]
    assert lines == [f"esi-sidecar drill: {url}: cannot reach the daemon: connection "
                     "refused (is `esi-sidecar serve` running?)"], lines
    assert "URLError" not in drill.stderr and "Errno" not in drill.stderr


def test_the_wait_says_where_the_drill_stands() -> None:
    assert progress_line("drill-1", 1000.0, 1030.0, 988.2) == (
        "drill-1: waiting for the job's save: drill deadline in 12 s")
    assert progress_line("drill-1", 1000.0, 1030.0, 1010.0) == (
        "drill-1: drill deadline passed 10 s ago; waiting for the job's report (no answer "
        "after 20 s more)")


def test_an_unreachable_reason_is_a_few_words() -> None:
    import urllib.error

    assert unreachable_reason(urllib.error.URLError(TimeoutError("timed out")), 5) == (
        "no answer within 5 s")
    assert unreachable_reason(urllib.error.URLError(ConnectionRefusedError(111, "x")), 5) \
        .startswith("connection refused")
