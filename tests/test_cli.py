"""The command line against the running daemon: status, check, env, --help."""

from __future__ import annotations

import json
import os
import pty
import re
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from daemon_harness import get_json, serve_daemon, wait_for
from drill_support import start_drill

from sidecar.cli.status_view import describe, format_duration
from sidecar.models import Expiry
from sidecar.timeparse import format_rfc3339


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "sidecar.cli", *args], capture_output=True,
                          text=True, timeout=60)


def dead_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0, "0s"), (59.9, "59s"), (61, "1m 01s"), (3723, "1h 02m 03s"), (90061, "1d 01h 01m 01s"),
     (-5, "-5s")],
)
def test_format_duration(seconds: float, text: str) -> None:
    assert format_duration(seconds) == text


def test_status_reads_like_a_sentence() -> None:
    deadline = time.time() + 3723.5
    expiry = Expiry(
        expires_at=format_rfc3339(deadline), expires_at_unix=deadline, remaining_seconds=3723.5,
        kind="scheduled-release", source="volcengine-esi", instance_id="i-1",
        scheduled_instance_id="esi-1", observed_at=None, age_seconds=4.2, stale=False,
        error=None, server_time_unix=time.time(),
    )
    first = describe(expiry)[0]
    assert first.startswith("releases in 1h 02m 03s at ")
    assert first.endswith(" UTC (volcengine-esi, polled 4s ago)")


def test_status_check_and_env_against_the_daemon() -> None:
    deadline = time.time() + 200
    with serve_daemon(sources=("static",), expires_at=format_rfc3339(deadline)) as daemon:
        wait_for(lambda: daemon.store.health().ok)
        status = cli("status", "--url", daemon.url)
        assert status.returncode == 0, status.stderr
        assert status.stdout.startswith("releases in 3m 1") and "(static, polled" in status.stdout

        raw = cli("status", "--json", "--url", daemon.url)
        assert json.loads(raw.stdout)["expires_at_unix"] == pytest.approx(deadline, abs=1e-3)

        # The worked example: 200 s left, 80 s step, 60 s save, 120 s redundant -> save now.
        now = cli("check", "--step-seconds", "80", "--url", daemon.url)
        assert now.returncode == 0 and now.stdout.startswith("save now")
        later = cli("check", "--step-seconds", "5", "--save-seconds", "10",
                    "--redundant-seconds", "10", "--url", daemon.url)
        assert later.returncode == 1 and later.stdout.startswith("not yet")

        env = cli("env", "--url", daemon.url)
        assert env.returncode == 0
        assert env.stdout.strip() == (
            f"MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP={int(deadline)}")


def test_unreachable_daemon_exits_3_with_a_hint() -> None:
    url = dead_url()
    for args in (("status",), ("check", "--step-seconds", "1"), ("env",)):
        result = cli(*args, "--url", url, "--timeout", "0.5")
        assert result.returncode == 3, args
        assert f"cannot reach the daemon: {url}" in result.stderr
        assert result.stderr.count(url) == 1


def test_usage_errors_exit_2() -> None:
    assert cli("check").returncode == 2  # --step-seconds is required
    assert cli("check", "--step-seconds", "-3").returncode == 2
    assert cli("frobnicate").returncode == 2
    assert cli("status", "--timeout", "0").returncode == 2
    bad_url = cli("status", "--url", "ftp://example.invalid")
    assert bad_url.returncode == 2 and "Traceback" not in bad_url.stderr
    assert bad_url.stderr.startswith("esi-sidecar status: --url")


def test_emulate_never_prints_the_real_secret_key() -> None:
    import os

    env = {**os.environ, "VOLCENGINE_SECRET_KEY": "real-secret-do-not-print"}
    process = subprocess.Popen(
        [sys.executable, "-m", "sidecar.cli", "emulate", "--listen", "127.0.0.1:0"],
        stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert process.stdout is not None
        lines = []
        for line in process.stdout:  # ends with the Ctrl-C line; bounded by the emulator
            lines.append(line)
            if line.startswith("Ctrl-C"):
                break
    finally:
        process.terminate()
        process.wait(10)
    printed = "".join(lines)
    assert "VOLCENGINE_SECRET_KEY=emulator-secret" in printed
    assert "real-secret-do-not-print" not in printed


def test_help_lists_every_command_and_serve_lists_every_variable() -> None:
    top = cli("--help").stdout
    for command in ("serve", "status", "check", "env", "emulate"):
        assert command in top
    serve = cli("serve", "--help").stdout
    for variable in ("ESI_SIDECAR_LISTEN", "ESI_SIDECAR_POLL_INTERVAL", "ESI_SIDECAR_API_ENDPOINT",
                     "ESI_SIDECAR_STATE_FILE"):
        assert variable in serve


def test_status_lists_every_notice_and_the_sources_auto_left_out(unused_port: int) -> None:
    from sidecar.tools.emulator.aws import AwsImdsEmulator

    dead = f"http://127.0.0.1:{unused_port}"
    with AwsImdsEmulator() as imds, serve_daemon(
            sources=("auto",), aws_imds_url=imds.url, metadata_url=dead,
            gcp_metadata_url=dead, azure_metadata_url=dead,
            # Fresh between the aws source's own 2 s polls: status exits 0 only when
            # healthy (issue 26, item 4).
            stale_after=10.0) as daemon:
        imds.interrupt(time.time() + 125, action="stop")
        imds.schedule_maintenance(time.time() + 7200)
        imds.recommend_rebalance(time.time())
        wait_for(lambda: len(get_json(daemon.url + "/v1/expiry")[1]["notices"]) == 3)
        # The capacity-block source answers its probe too (the same IMDS), then finds no
        # AWS credentials here: skipped with that reason once its first poll has run.
        wait_for(lambda: "aws-capacity-block" in get_json(daemon.url + "/healthz")[1]["skipped"])
        status = cli("status", "--url", daemon.url)
    lines = status.stdout.splitlines()
    assert status.returncode == 0, status.stderr
    assert lines[0].startswith("reclaimed in 2m 0") and "[preemption-notice] (aws" in lines[0]
    notices = lines[lines.index("notices:") + 1:][:3]
    assert "in 2m 0" in notices[0] and "spot stop" in notices[0]
    assert "scheduled-maintenance" in notices[1] and "in 1h 59m" in notices[1]
    assert "advice" in notices[2] and "rebalance recommended" in notices[2]
    assert "sources: aws" in lines
    # The sources whose service is not here: one line, their reasons in /healthz (issue
    # 39, item 10: five lines of "not on this machine"); a refusal: its own line.
    absent = [line for line in lines if line.startswith("not on this machine: ")]
    assert absent == ["not on this machine: azure, gcp, slurm, volcengine-esi, "
                      "volcengine-events, volcengine-spot (why: /healthz)"]
    (refused,) = [line for line in lines if line.startswith("left out: ")]
    assert refused.split()[2] == "aws-capacity-block" and "no AWS credentials" in refused


@pytest.mark.parametrize("cloud", ["aws", "gcp", "azure"])
def test_emulate_another_cloud_prints_lines_that_work_as_pasted(cloud: str) -> None:
    """The printed serve line reaches the emulator, and the printed curl raises a notice
    that the daemon then serves."""
    import re
    import shlex
    import urllib.request

    process = subprocess.Popen(
        [sys.executable, "-m", "sidecar.cli", "emulate", "--cloud", cloud,
         "--listen", "127.0.0.1:0"], stdout=subprocess.PIPE, text=True)
    try:
        assert process.stdout is not None
        lines = []
        for line in process.stdout:
            lines.append(line.strip())
            if line.startswith("Ctrl-C"):
                break
        serve = next(line for line in lines if line.startswith("esi-sidecar serve"))
        curl = next(line for line in lines if line.startswith("Raise a notice:"))
        words = shlex.split(serve)[2:]
        options = dict(zip(words[::2], words[1::2]))
        setting = {"aws": "aws_imds_url", "gcp": "gcp_metadata_url",
                   "azure": "azure_metadata_url"}[cloud]
        with serve_daemon(sources=(options["--source"],),
                          **{setting: options[f"--{setting.replace('_', '-')}"]}) as daemon:
            wait_for(lambda: daemon.store.health().ok, timeout=10)
            url, body = re.search(r"curl -X POST (\S+) -d '(.*)'", curl).groups()  # type: ignore[union-attr]
            request = urllib.request.Request(url, data=body.encode(), method="POST")
            with urllib.request.urlopen(request, timeout=5) as answer:
                assert answer.status == 200
            wait_for(lambda: get_json(daemon.url + "/v1/expiry")[1]["expires_at"], timeout=10)
    finally:
        process.terminate()
        process.wait(10)


def test_status_watch_prints_a_block_per_interval_when_not_a_terminal() -> None:
    release = time.time() + 3600
    with serve_daemon(sources=("static",), expires_at=str(release)) as daemon:
        wait_for(lambda: get_json(daemon.url + "/healthz")[0] == 200)
        result = cli("status", "--watch", "--interval", "0.2", "--count", "3",
                     "--url", daemon.url)
    assert result.returncode == 0, result.stderr
    blocks = [b for b in result.stdout.split("--- ") if b.strip()]
    assert len(blocks) == 3, result.stdout
    for block in blocks:
        assert re.match(r"\d\d:\d\d:\d\d UTC\n", block), block
        assert "releases in 59m" in block or "releases in 1h 00m" in block, block
        assert "sources: static" in block
    assert "\x1b[" not in result.stdout  # no terminal codes in a pipe


def test_status_watch_shows_the_drill_under_way_then_the_last_one() -> None:
    with serve_daemon(sources=("static",), expires_at=str(time.time() + 3600)) as daemon:
        wait_for(lambda: get_json(daemon.url + "/healthz")[0] == 200)
        post_json(daemon.url + "/v1/events", {
            "kind": "step-estimate", "job": "trainer:1", "step_seconds": 0.1,
            "save_seconds": 1.0, "budget_seconds": 20.0, "remaining_seconds": 3600.0})
        start_drill(daemon.url, 30)
        running = cli("status", "--watch", "--count", "1", "--url", daemon.url)
        post_json(daemon.url + "/v1/events", {
            "kind": "drill", "job": "trainer:1", "step": 41, "drill": {
                "id": "drill-1", "outcome": "durable", "budget_seconds": 20.0,
                "save_seconds": 1.5, "upload_seconds": 3.0, "durable_seconds": 4.5,
                "lead_seconds": 12.5, "remaining_seconds": 17.0}})
        wait_for(lambda: get_json(daemon.url + "/v1/drill")[1]["drills"][0]["result"])
        decided = cli("status", "--watch", "--interval", "0.2", "--count", "2",
                      "--url", daemon.url)
        once = cli("status", "--url", daemon.url)
    assert running.returncode == 0, running.stderr
    assert "drill: drill-1 under way" in running.stdout, running.stdout
    assert decided.returncode == 0, decided.stderr
    blocks = [b for b in decided.stdout.split("--- ") if b.strip()]
    assert len(blocks) == 2, decided.stdout
    last = [line for line in once.stdout.splitlines() if line.startswith("last drill: ")]
    assert last and "drill-1 PASS" in last[0], once.stdout
    said = last[0].rsplit(", ", 1)[0]  # the same line `status` prints, but for its "ago"
    for block in blocks:
        assert any(line.startswith(said) for line in block.splitlines()), block


def post_json(url: str, body: object) -> None:
    request = urllib.request.Request(url, method="POST", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=5) as response:
        assert response.status in (201, 202), response.status


def test_status_watch_redraws_in_place_on_a_terminal() -> None:
    release = time.time() + 600
    with serve_daemon(sources=("static",), expires_at=str(release)) as daemon:
        wait_for(lambda: get_json(daemon.url + "/healthz")[0] == 200)
        primary, secondary = pty.openpty()
        try:
            process = subprocess.run(
                [sys.executable, "-m", "sidecar.cli", "status", "--watch", "--interval", "0.2",
                 "--count", "2", "--url", daemon.url],
                stdout=secondary, stderr=subprocess.PIPE, timeout=60)
            os.close(secondary)
            secondary = -1
            output = b""
            while True:
                try:
                    chunk = os.read(primary, 65536)
                except OSError:
                    break
                if not chunk:
                    break
                output += chunk
        finally:
            if secondary >= 0:
                os.close(secondary)
            os.close(primary)
    assert process.returncode == 0, process.stderr
    text = output.decode()
    assert text.count("\x1b[H\x1b[2J") == 2, text  # cleared and redrawn, twice
    assert "(Ctrl-C to stop)" in text and "releases in 9m" in text


def test_status_watch_keeps_trying_a_dead_daemon() -> None:
    result = cli("status", "--watch", "--interval", "0.1", "--count", "2", "--url", dead_url())
    assert result.returncode == 0
    assert result.stdout.count("daemon unreachable") == 2
    assert "(still trying)" in result.stdout


def _into_a_closed_pipe(*args: str) -> subprocess.CompletedProcess[str]:
    """The command with stdout a pipe whose reader is already gone: the extreme of
    `| head -1`, which closes after a line, so every write fails (EPIPE)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run([sys.executable, "-m", "sidecar.cli", *args], stdout=write_end,
                              stderr=subprocess.PIPE, text=True, timeout=120, check=False)
    finally:
        os.close(write_end)


def test_a_reader_that_closes_early_ends_every_command_quietly_with_141() -> None:
    with serve_daemon(sources=("static",), expires_at=format_rfc3339(time.time() + 600)) as d:
        wait_for(lambda: d.store.health().ok)
        for args in (("status", "--url", d.url), ("status", "--json", "--url", d.url),
                     ("check", "--step-seconds", "1", "--url", d.url),
                     ("env", "--url", d.url), ("simulate", "--list")):
            result = _into_a_closed_pipe(*args)
            assert (result.returncode, result.stderr) == (141, ""), args
        # As a shell runs it: `esi-sidecar status | head -1`, whichever ends first.
        shell = subprocess.run(
            ["bash", "-o", "pipefail", "-c",
             f"{sys.executable} -m sidecar.cli status --url {d.url} | head -1"],
            capture_output=True, text=True, timeout=60, check=False)
        assert shell.stdout.startswith("releases in "), shell.stdout
        assert "Traceback" not in shell.stderr and "BrokenPipe" not in shell.stderr
        assert shell.returncode in (0, 141), shell.stderr


def test_restore_help_describes_restore_not_the_upload() -> None:
    result = cli("restore", "--help")
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())
    assert "--to DIR local checkpoint folder to restore into" in text
    assert "[env ESI_SIDECAR_UPLOAD_FROM]" in text
    assert "--from URL where to fetch the checkpoint from: s3://BUCKET/PREFIX" in text
    assert "[env ESI_SIDECAR_UPLOAD_TO]" in text
    assert "--concurrency N parts and files downloaded at once (default 8)" in text
    for uploader_words in ("to upload from", "where complete checkpoints go",
                           "uploaded at once", "for the upload"):
        assert uploader_words not in text, uploader_words


def _nothing_runs(dead: str) -> dict[str, object]:
    """--source auto where no metadata service answers: degraded (issue 26, item 4)."""
    return {"sources": ("auto",), "metadata_url": dead, "aws_imds_url": dead,
            "gcp_metadata_url": dead, "azure_metadata_url": dead}


def test_status_exits_4_when_the_daemon_is_not_healthy_and_says_why(unused_port: int) -> None:
    with serve_daemon(**_nothing_runs(f"http://127.0.0.1:{unused_port}")) as daemon:
        wait_for(lambda: daemon.poller.first_attempt_done.is_set())
        status = cli("status", "--url", daemon.url)
        raw = cli("status", "--json", "--url", daemon.url)
    assert status.returncode == 4, status.stderr
    assert "not healthy: degraded: no deadline source can run here" in status.stderr
    assert raw.returncode == 4 and json.loads(raw.stdout)["expires_at"] is None
    assert "4:" in cli("status", "--help").stdout  # the codes are documented


def test_status_wait_healthy_waits_for_a_daemon_that_becomes_healthy(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from sidecar.tools.emulator import Emulator

    monkeypatch.setenv("VOLCENGINE_ACCESS_KEY", "AKLTtestaccesskey0001")
    monkeypatch.setenv("VOLCENGINE_SECRET_KEY", "c2VjcmV0LXNlY3JldC1zZWNyZXQ=")
    with Emulator(access_key="AKLTtestaccesskey0001", secret_key="c2VjcmV0LXNlY3JldC1zZWNyZXQ=",
                  region="cn-beijing", instance_id="i-w1", scheduled_instance_id="esi-w1",
                  auto_release_at=None) as emu, serve_daemon(
            sources=("volcengine-esi",), api_endpoint=emu.url, metadata_url=emu.url) as daemon:
        emu.set_release_in(3600)
        emu.inject_fault("server-error")
        wait_for(lambda: get_json(daemon.url + "/healthz")[1]["sources"]["volcengine-esi"]
                 ["error"])
        # Unhealthy before the wait starts: a source with a fresh error can still be
        # healthy for a moment, and the wait would then end before any release was read.
        wait_for(lambda: get_json(daemon.url + "/healthz")[0] == 503, timeout=15)
        waiting = subprocess.Popen(
            [sys.executable, "-m", "sidecar.cli", "status", "--wait-healthy", "30",
             "--url", daemon.url], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            emu.clear_faults()
            out, err = waiting.communicate(timeout=40)
        finally:
            waiting.kill()
        emu.inject_fault("server-error")
        wait_for(lambda: get_json(daemon.url + "/healthz")[0] == 503, timeout=15)
        started = time.monotonic()
        gave_up = cli("status", "--wait-healthy", "1", "--url", daemon.url)
        waited = time.monotonic() - started
    assert waiting.returncode == 0, err
    assert out.startswith("releases in ")
    assert gave_up.returncode == 4 and "not healthy" in gave_up.stderr
    assert waited >= 1.0
