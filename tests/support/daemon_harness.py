"""Run the real daemon in-process on 127.0.0.1, port 0, for tests.

    with serve_daemon(sources=("static",), expires_at="2030-01-01T00:00:00Z") as daemon:
        urllib.request.urlopen(daemon.url + "/v1/expiry")

Everything real: the settings object, the sources, the poller threads, FastAPI and uvicorn
on a bound socket. Only the address is chosen by the kernel.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Optional

from sidecar.host.daemon import Daemon, bind_sockets, build_daemon, make_server
from sidecar.host.poller import Poller
from sidecar.host.settings import Settings
from sidecar.host.store import Store


@dataclass
class RunningDaemon:
    url: str
    daemon: Daemon

    @property
    def store(self) -> Store:
        return self.daemon.store

    @property
    def poller(self) -> Poller:
        return self.daemon.poller

    @property
    def settings(self) -> Settings:
        return self.daemon.settings


def get_json(url: str, timeout: float = 5.0) -> tuple[int, Any]:
    """GET a JSON body: (status, body), for error statuses too. Raises when unreachable."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def fetch_json(url: str, timeout: float = 2.0) -> Optional[tuple[int, Any]]:
    """Like :func:`get_json`, but None while nothing answers (a daemon still starting)."""
    try:
        return get_json(url, timeout)
    except (urllib.error.URLError, OSError, ValueError):
        return None


def wait_for(predicate: Any, timeout: float = 10.0, interval: float = 0.01) -> Any:
    """Poll ``predicate`` until it returns something truthy; fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s: {predicate}")
        time.sleep(interval)


@contextmanager
def serve_daemon(**overrides: Any) -> Iterator[RunningDaemon]:
    """Start the daemon with ``Settings(**overrides)`` and stop it on exit."""
    overrides.setdefault("listen", (("127.0.0.1", 0),))
    overrides.setdefault("poll_interval", 0.2)
    # Every --poll-interval: the tests move releases hours ahead and expect to see it at
    # the next poll. The adaptive schedule has tests of its own (test_schedule.py).
    overrides.setdefault("poll_schedule", "fixed")
    # Never the default (auto): it would probe the clouds' link-local metadata addresses.
    overrides.setdefault("sources", ("volcengine-esi",))
    settings = Settings(**overrides)
    sockets = bind_sockets(settings.listen)
    host, port = sockets[0].getsockname()[:2]
    daemon = build_daemon(settings)
    server = make_server(daemon)
    thread = threading.Thread(target=server.run, kwargs={"sockets": sockets}, daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started or not thread.is_alive())
        if not server.started:
            raise RuntimeError("the daemon did not start")
        yield RunningDaemon(f"http://{host}:{port}", daemon)
    finally:
        server.should_exit = True
        thread.join(10)
        for sock in sockets:
            sock.close()
