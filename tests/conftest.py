from __future__ import annotations

import ipaddress
import os
import socket
import sys
from pathlib import Path
from typing import Any

import pytest

# Tests import the harness and the other helpers in tests/support/ as plain modules.
sys.path.insert(0, str(Path(__file__).parent / "support"))


def _loopback_only(connect: Any) -> Any:
    """socket.connect that refuses any address off this machine: the tests talk to
    loopback only, and a default that probes a cloud's metadata address (169.254.169.254)
    must fail here loudly instead of sending a packet."""

    def guarded(sock: socket.socket, address: Any) -> Any:
        if sock.family in (socket.AF_INET, socket.AF_INET6) and isinstance(address, tuple):
            host = address[0]
            try:
                loopback = ipaddress.ip_address(host.split("%")[0]).is_loopback
            except ValueError:
                loopback = host == "localhost"
            if not loopback:
                raise OSError(f"tests may reach loopback only, not {host!r}")
        return connect(sock, address)

    return guarded


socket.socket.connect = _loopback_only(socket.socket.connect)  # type: ignore[method-assign]
socket.socket.connect_ex = _loopback_only(socket.socket.connect_ex)  # type: ignore[method-assign]

# The machine's own cloud credentials never reach a test (or a daemon it starts): a test
# that wants credentials sets them itself, so one that must run without them cannot pick
# up a developer's ~/.aws and start a source that then talks to a stand-in it did not set up.
for _name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
              "AWS_PROFILE", "AWS_DEFAULT_PROFILE"):
    os.environ.pop(_name, None)
os.environ["AWS_SHARED_CREDENTIALS_FILE"] = os.devnull
os.environ["AWS_CONFIG_FILE"] = os.devnull

# CI sets this: there every tool and package is installed on purpose, so a skip means
# something went missing and must not pass for green. The one skip allowed names a
# kernel feature, not an install step.
FAIL_ON_SKIP = "SIDECAR_TESTS_FAIL_ON_SKIP"
ALLOWED_SKIPS = ("cannot boot systemd in namespaces here",)


@pytest.fixture
def unused_port() -> int:
    """A loopback port nobody listens on (bound, read, released)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


@pytest.fixture(scope="module")
def s3() -> Any:
    """A real S3-protocol server (moto) on loopback, one per test module."""
    from upload_support import running_s3  # moto only for the tests that ask

    with running_s3() as server:
        yield server


@pytest.fixture
def bucket(s3: Any, request: pytest.FixtureRequest) -> Any:
    """A fresh bucket named after the test."""
    return s3.bucket("t-" + request.node.name.replace("_", "-").lower()[:50].strip("-"))


def _unexpected_skips(session: pytest.Session) -> list[Any]:
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter is not None else []
    return [
        report for report in skipped
        if not any(allowed in str(report.longrepr) for allowed in ALLOWED_SKIPS)
    ]


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if os.environ.get(FAIL_ON_SKIP) and exitstatus == 0 and _unexpected_skips(session):
        session.exitstatus = 1


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: Any) -> None:
    if os.environ.get(FAIL_ON_SKIP):
        skips = _unexpected_skips(terminalreporter._session)
        if skips:
            terminalreporter.write_line(
                f"{FAIL_ON_SKIP} is set: {len(skips)} skipped test(s) count as failures "
                "(see the skip reasons above)", red=True)
