"""systemd's service notification protocol (sd_notify), standard library only.

With ``Type=notify`` systemd waits for ``READY=1`` before it calls the service started,
and with ``WatchdogSec=`` it restarts a service that stops sending ``WATCHDOG=1``. Both
are one datagram on the socket named by ``$NOTIFY_SOCKET``; outside systemd the variable
is unset and every call here does nothing.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping
from typing import Optional

__all__ = ["notify", "watchdog_interval"]

log = logging.getLogger("sidecar.host.notify")


def notify(message: str, environ: Optional[Mapping[str, str]] = None) -> bool:
    """Send one notification (e.g. ``"READY=1"``). Returns False when not under systemd."""
    environ = os.environ if environ is None else environ
    address = environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):  # abstract namespace socket
        address = "\0" + address[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall(message.encode())
    except OSError as exc:
        log.warning("sd_notify %s failed: %s", message.split("=")[0], exc)
        return False
    return True


def watchdog_interval(environ: Optional[Mapping[str, str]] = None) -> Optional[float]:
    """Half of systemd's watchdog timeout in seconds, or None when no watchdog is set.

    ``WATCHDOG_PID`` (when present) must be this process, as sd_watchdog_enabled() checks.
    """
    environ = os.environ if environ is None else environ
    usec = environ.get("WATCHDOG_USEC")
    pid = environ.get("WATCHDOG_PID")
    if not usec or (pid and pid.strip() != str(os.getpid())):
        return None
    try:
        seconds = int(usec) / 1_000_000
    except ValueError:
        return None
    return seconds / 2 if seconds > 0 else None
