"""The daemon's log under systemd's journal: a ``<N>`` syslog priority on every line and no
timestamp of ours when ``$JOURNAL_STREAM`` is stderr's own device and inode; plain,
timestamped lines when it is not (a child that inherited the variable). Real processes
whose stderr is a file standing for the journal's stream."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

from daemon_harness import fetch_json, wait_for

from sidecar.host.journal import syslog_priority

TIMESTAMP = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d")
CHILD = r"""
import logging, sys
from sidecar.host.journal import configure_logging

print(configure_logging("DEBUG"), flush=True)
log = logging.getLogger("sidecar.test")
log.debug("a debug line")
log.info("an info line")
log.warning("a warning line")
try:
    raise ValueError("the cause")
except ValueError:
    log.exception("an error line")
"""


def _journal_stream(path: Path) -> str:
    status = os.stat(path)
    return f"{status.st_dev}:{status.st_ino}"


def _run_child(log_file: Path, journal_stream: str) -> tuple[str, str]:
    env = {**os.environ, "JOURNAL_STREAM": journal_stream}
    with open(log_file, "w") as stderr:
        result = subprocess.run([sys.executable, "-c", CHILD], stderr=stderr, env=env,
                                capture_output=False, stdout=subprocess.PIPE, text=True,
                                timeout=60, check=False)
    assert result.returncode == 0, log_file.read_text()
    return result.stdout.strip(), log_file.read_text()


def test_priorities_follow_sd_daemon() -> None:
    assert [syslog_priority(level) for level in (50, 40, 30, 20, 10, 5)] == [2, 3, 4, 6, 7, 7]


def test_under_the_journal_every_line_has_its_priority_and_no_timestamp(tmp_path: Path) -> None:
    log_file = tmp_path / "stderr"
    log_file.touch()
    journal, text = _run_child(log_file, _journal_stream(log_file))
    assert journal == "True"
    lines = text.splitlines()
    assert lines[:4] == ["<7>DEBUG sidecar.test: a debug line",
                         "<6>INFO sidecar.test: an info line",
                         "<4>WARNING sidecar.test: a warning line",
                         "<3>ERROR sidecar.test: an error line"]
    traceback = lines[4:]
    assert traceback[0] == "<3>Traceback (most recent call last):"
    assert traceback[-1] == "<3>ValueError: the cause"
    assert all(line.startswith("<3>") for line in traceback), traceback
    assert not TIMESTAMP.search(text)


def test_elsewhere_plain_lines_with_a_timestamp(tmp_path: Path) -> None:
    log_file = tmp_path / "stderr"
    log_file.touch()
    other = tmp_path / "journal"  # the variable names another file: inherited, not ours
    other.touch()
    journal, text = _run_child(log_file, _journal_stream(other))
    assert journal == "False"
    lines = text.splitlines()
    assert re.fullmatch(rf"{TIMESTAMP.pattern},\d+ INFO sidecar.test: an info line", lines[1])
    assert not any(line.startswith("<") for line in lines), lines


def _serve(tmp_path: Path, journal_stream: str) -> str:
    """``esi-sidecar serve`` with a source whose metadata service refuses (a warning; a
    static deadline long past is refused at start now), stopped by SIGTERM (an info line:
    state flushed); its stderr as written."""
    log_file = tmp_path / "serve.stderr"
    log_file.touch()
    stream = journal_stream or _journal_stream(log_file)
    with socket.socket() as sock, socket.socket() as closed:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        closed.bind(("127.0.0.1", 0))  # bound, never listening: connections refused
        dead = closed.getsockname()[1]
    with open(log_file, "w") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-m", "sidecar.cli", "serve", "--source", "static,volcengine-spot",
             "--expires-at", "2030-01-01T00:00:00Z", "--metadata-url", f"http://127.0.0.1:{dead}",
             "--listen", f"127.0.0.1:{port}",
             "--state-file", str(tmp_path / "state.json")],
            env={**os.environ, "JOURNAL_STREAM": stream}, stdout=stderr, stderr=stderr)
        try:
            wait_for(lambda: fetch_json(f"http://127.0.0.1:{port}/v1/expiry"), timeout=30)
            wait_for(lambda: "source volcengine-spot:" in log_file.read_text(), timeout=30)
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=20)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait(10)
    return log_file.read_text()


def test_serve_logs_for_the_journal_when_stderr_is_the_journal(tmp_path: Path) -> None:
    text = _serve(tmp_path, journal_stream="")
    lines = [line for line in text.splitlines() if line]
    assert all(re.match(r"<[2-7]>", line) for line in lines), lines
    assert any(line.startswith("<4>WARNING sidecar.host.poller: source volcengine-spot:")
               for line in lines), lines
    assert any(line.startswith("<6>") and "state flushed" in line for line in lines), lines
    assert not TIMESTAMP.search(text)


def test_serve_logs_plain_lines_when_stderr_is_not_the_journal(tmp_path: Path) -> None:
    text = _serve(tmp_path, journal_stream="1:1")
    lines = [line for line in text.splitlines() if line]
    warning = " WARNING sidecar.host.poller: source volcengine-spot:"
    assert any(TIMESTAMP.match(line) and warning in line for line in lines), lines
    assert not any(re.match(r"<\d>", line) for line in lines), lines
