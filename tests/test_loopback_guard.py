"""The loopback guard (tests/support/loopback_guard.py), proved without a packet leaving:
the real connect is swapped for a recorder, so a guard that let an address through would
only be recorded, never sent."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from typing import Any

import loopback_guard
import pytest
from conftest import CLOSED_URL, METADATA_URL_SETTINGS

# Run in this process and in a child started as the tests start daemons: the recorder
# replaces the real connect behind the guard, then the script tries three addresses.
PROBE = textwrap.dedent("""
    import json, socket
    guard = socket.socket.connect
    recorded = []
    real = getattr(guard, "__wrapped__", None)
    guard.__wrapped__ = lambda sock, address: recorded.append(address[0])
    results = {}
    try:
        for host in ("169.254.169.254", "100.96.0.96", "127.0.0.1", "::1"):
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            with socket.socket(family) as sock:
                try:
                    sock.connect((host, 80))
                    results[host] = "passed"
                except OSError as exc:
                    results[host] = type(exc).__name__ + ": " + str(exc)
    finally:
        guard.__wrapped__ = real
    print(json.dumps({"guarded": real is not None, "recorded": recorded,
                      "results": results}))
""")


def _check(outcome: dict[str, Any]) -> None:
    assert outcome["guarded"], "socket.socket.connect is not the guard"
    assert outcome["recorded"] == ["127.0.0.1", "::1"]  # loopback reaches the real connect
    for host in ("169.254.169.254", "100.96.0.96"):
        assert outcome["results"][host].startswith("BeyondLoopbackError: ")
        assert f"tests may reach loopback only, not '{host}'" in outcome["results"][host]


def test_the_test_process_refuses_a_metadata_address_before_the_real_connect(
        capsys: pytest.CaptureFixture[str]) -> None:
    namespace: dict[str, Any] = {}
    exec(PROBE, namespace)
    _check(json.loads(capsys.readouterr().out))


def test_a_child_process_refuses_it_too_and_says_so_on_stderr() -> None:
    done = subprocess.run([sys.executable, "-c", PROBE], env=dict(os.environ),
                          capture_output=True, text=True, timeout=60, check=True)
    _check(json.loads(done.stdout))
    assert "loopback guard (pid" in done.stderr and "169.254.169.254" in done.stderr


def test_connect_ex_is_guarded_as_well() -> None:
    guard = socket.socket.connect_ex
    recorded: list[Any] = []
    real = guard.__wrapped__  # type: ignore[attr-defined]
    guard.__wrapped__ = lambda sock, address: recorded.append(address)  # type: ignore[attr-defined]
    try:
        with socket.socket() as sock, pytest.raises(loopback_guard.BeyondLoopbackError):
            sock.connect_ex(("169.254.169.254", 80))
    finally:
        guard.__wrapped__ = real  # type: ignore[attr-defined]
    assert recorded == []


def test_another_network_namespace_is_the_tests_own() -> None:
    # A process in a namespace other than the session's (unshare --net) reaches its own
    # addresses: the decision, with the namespace read as another one.
    recorded: list[Any] = []
    guarded = loopback_guard.guard(lambda sock, address: recorded.append(address[0]),
                                   host_netns="net:[another]")
    with socket.socket() as sock:
        guarded(sock, ("10.203.0.1", 80))
    assert recorded == ["10.203.0.1"]


def test_every_metadata_url_points_at_a_closed_loopback_port() -> None:
    for name in METADATA_URL_SETTINGS:
        assert os.environ[name] == CLOSED_URL
    host, port = CLOSED_URL.removeprefix("http://").split(":")
    with socket.socket() as sock, pytest.raises(ConnectionRefusedError):
        sock.connect((host, int(port)))
    # Every URL setting of a source is covered: a new one must be added above.
    from sidecar.host.settings import OPTIONS
    urls = {option.env for option in OPTIONS
            if "metadata" in option.name or option.name.endswith("imds_url")}
    assert urls == set(METADATA_URL_SETTINGS)


def test_pip_alone_may_reach_the_package_registries(monkeypatch: pytest.MonkeyPatch) -> None:
    recorded: list[Any] = []
    guarded = loopback_guard.guard(lambda sock, address: recorded.append(address[0]),
                                   host_netns=loopback_guard.current_netns())
    for program in ("/venv/bin/pip", "/venv/lib/python3.11/site-packages/pip/__main__.py",
                    "/venv/lib/python3.11/site-packages/pip/__pip-runner__.py"):
        monkeypatch.setattr(sys, "argv", [program, "install"])
        with socket.socket() as sock:
            guarded(sock, ("203.0.113.80", 443))
    monkeypatch.setattr(sys, "argv", ["/venv/bin/esi-sidecar", "serve"])
    with socket.socket() as sock, pytest.raises(loopback_guard.BeyondLoopbackError):
        guarded(sock, ("203.0.113.80", 443))
    assert recorded == ["203.0.113.80"] * 3
