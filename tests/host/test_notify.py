"""sd_notify against a real datagram socket, as systemd would hold it."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_harness import serve_daemon

from sidecar.host.notify import notify, watchdog_interval


@pytest.fixture
def notify_socket(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[socket.socket]:
    path = tmp_path / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        sock.settimeout(10)
        monkeypatch.setenv("NOTIFY_SOCKET", str(path))
        yield sock


def receive_until(sock: socket.socket, prefix: str) -> str:
    while True:
        message = sock.recv(4096).decode()
        if message.startswith(prefix):
            return message


def test_notify_does_nothing_outside_systemd(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert notify("READY=1") is False


def test_notify_sends_one_datagram(notify_socket: socket.socket) -> None:
    assert notify("READY=1") is True
    assert notify_socket.recv(4096) == b"READY=1"


def test_abstract_socket_names(monkeypatch: pytest.MonkeyPatch) -> None:
    name = f"esi-sidecar-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(5)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert notify("WATCHDOG=1")
        assert sock.recv(100) == b"WATCHDOG=1"


def test_dead_notify_socket_is_a_warning_not_a_crash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "absent.sock"))
    assert notify("READY=1") is False


def test_watchdog_interval_is_half_the_timeout_for_this_process() -> None:
    assert watchdog_interval({"WATCHDOG_USEC": "30000000"}) == 15.0
    assert watchdog_interval({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid())}) == 15
    assert watchdog_interval({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"}) is None
    assert watchdog_interval({}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "soon"}) is None


def test_daemon_sends_ready_after_first_poll_then_watchdog_pings(
    notify_socket: socket.socket, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", "200000")  # ping every 0.1 s
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    with serve_daemon(sources=("static",), expires_at="2030-01-01T00:00:00Z") as daemon:
        ready = receive_until(notify_socket, "READY=1")
        assert "STATUS=ok" in ready
        assert daemon.store.snapshot().sources[0].observation is not None  # polled first
        receive_until(notify_socket, "WATCHDOG=1")
        receive_until(notify_socket, "WATCHDOG=1")
    assert receive_until(notify_socket, "STOPPING=1") == "STOPPING=1"
