"""``esi-sidecar serve`` as a real process: listen addresses, SIGTERM, state across restarts."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from daemon_harness import fetch_json, wait_for


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def fetch(url: str) -> dict | None:
    """The body of a 200 answer, else None (not up yet, or not healthy yet)."""
    answer = fetch_json(url)
    return answer[1] if answer and answer[0] == 200 else None


@contextmanager
def serve(*args: str, env: dict[str, str] | None = None) -> Iterator[subprocess.Popen]:
    process = subprocess.Popen(
        [sys.executable, "-m", "sidecar.cli", "serve", *args],
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(10)


def test_serves_on_several_addresses_and_stops_on_sigterm_within_5_s(tmp_path: Path) -> None:
    first, second = free_port("127.0.0.1"), free_port("127.0.0.2")
    state = tmp_path / "state" / "state.json"
    with serve(
        "--source", "static", "--expires-at", "2030-01-01T00:00:00Z",
        "--listen", f"127.0.0.1:{first},127.0.0.2:{second}",
        "--state-file", str(state),
    ) as process:
        for url in (f"http://127.0.0.1:{first}", f"http://127.0.0.2:{second}"):
            body = wait_for(lambda url=url: fetch(url + "/v1/expiry"), timeout=30)
            assert body["expires_at"] == "2030-01-01T00:00:00Z"
        started = time.monotonic()
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=10)
        assert time.monotonic() - started < 5
        output = process.stdout.read() if process.stdout else ""
        assert "state flushed" in output
    saved = json.loads(state.read_text())
    assert saved["sources"]["static"]["observation"]["expires_at_unix"] == 1893456000.0


def test_restart_serves_the_saved_state_as_stale_until_a_poll_succeeds(tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    port = free_port()
    env_name = "MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP"
    common = ["--source", "env", "--listen", f"127.0.0.1:{port}", "--state-file", str(state),
              "--poll-interval", "0.2"]
    with serve(*common, env={env_name: "1900000000"}) as process:
        wait_for(lambda: (fetch(f"http://127.0.0.1:{port}/v1/expiry") or {}).get("expires_at"),
                 timeout=30)
        process.send_signal(signal.SIGTERM)
        process.wait(10)
    # Second run: the source now fails; the last good deadline is still served, as stale.
    with serve(*common, env={env_name: "garbage"}):
        body = wait_for(lambda: fetch(f"http://127.0.0.1:{port}/v1/expiry"), timeout=30)
        assert body["expires_at_unix"] == 1900000000
        assert body["stale"] is True
        assert "garbage" in (wait_for(
            lambda: fetch(f"http://127.0.0.1:{port}/v1/expiry")["error"]))


def test_an_address_that_cannot_be_bound_stops_start_up_with_one_line() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "sidecar.cli", "serve", "--source", "static",
             "--expires-at", "2030-01-01T00:00:00Z", "--listen", f"127.0.0.1:{port}"],
            capture_output=True, text=True, timeout=60,
        )
    assert result.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr
