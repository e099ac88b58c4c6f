"""Refuse every connection beyond loopback, in the test process and every process it starts.

The tests talk to loopback only (and to the network namespaces they make themselves). A
default that probes a cloud's metadata address (169.254.169.254, 100.96.0.96) must fail here
loudly instead of sending a packet, whichever process tries it: pytest itself, a daemon it
starts with ``esi-sidecar serve``, an example, a rank worker.

:func:`install` wraps ``socket.socket.connect`` and ``connect_ex``. :func:`child_environment`
says what a child needs to install it too: ``tests/support/netguard/`` holds a
``sitecustomize`` that Python imports at start-up from ``PYTHONPATH``. A process inside a
network namespace other than the test session's (``unshare --net``, which has only its own
loopback and whatever the test adds) may reach any address there: nothing leaves it.
pip alone may reach the package registries (:func:`is_pip`): the install tests install
from them, as a user does.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import sys
from pathlib import Path
from typing import Any, Callable

HOST_NETNS = "ESI_SIDECAR_TESTS_HOST_NETNS"  # the test session's namespace (its inode)
SITE_DIR = Path(__file__).parent / "netguard"


class BeyondLoopbackError(ConnectionRefusedError):
    """A connect to an address off this machine, refused before any packet is sent."""


def current_netns() -> str:
    try:
        return os.readlink("/proc/self/ns/net")
    except OSError:  # no procfs: treat as the host's namespace
        return ""


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return host == "localhost"


def is_pip() -> bool:
    """This process is pip (``pip``, ``python -m pip``, or pip's build-dependency runner):
    the install tests install from the package registries this machine is set up with, the
    one outside service the tests may use, and only through pip."""
    program = Path(sys.argv[0] if sys.argv and sys.argv[0] else "")
    return program.name.startswith("pip") or program.parent.name == "pip"


def guard(connect: Callable[..., Any], host_netns: str) -> Callable[..., Any]:
    """``connect`` that raises :class:`BeyondLoopbackError` for an address beyond loopback,
    unless this process runs in a network namespace other than ``host_netns``."""

    def guarded(sock: socket.socket, address: Any) -> Any:
        if sock.family in (socket.AF_INET, socket.AF_INET6) and isinstance(address, tuple):
            host = str(address[0])
            if not is_loopback(host) and current_netns() == host_netns and not is_pip():
                message = (f"tests may reach loopback only, not {host!r} (port {address[1]}): "
                           "point this URL at 127.0.0.1")
                print(f"loopback guard (pid {os.getpid()}): {message}", file=sys.stderr)
                raise BeyondLoopbackError(message)
        return guarded.__wrapped__(sock, address)  # type: ignore[attr-defined]

    # Looked up at each call, so a test can swap the real connect for a recorder.
    guarded.__wrapped__ = connect  # type: ignore[attr-defined]
    return guarded


def install() -> None:
    """Guard this process (once), and pass the guard on to every child through the
    environment."""
    host_netns = os.environ.setdefault(HOST_NETNS, current_netns())
    if not hasattr(socket.socket.connect, "__wrapped__"):
        socket.socket.connect = guard(socket.socket.connect, host_netns)  # type: ignore[method-assign]
        socket.socket.connect_ex = guard(  # type: ignore[method-assign]
            socket.socket.connect_ex, host_netns)
    os.environ.update(child_environment(os.environ))


def child_environment(environ: dict[str, str] | Any) -> dict[str, str]:
    """The variables that make a Python child install the guard at start-up."""
    paths = [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(SITE_DIR) not in paths:
        paths.insert(0, str(SITE_DIR))
    return {"PYTHONPATH": os.pathsep.join(paths),
            HOST_NETNS: environ.get(HOST_NETNS) or current_netns()}
