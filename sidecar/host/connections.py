"""How many connections the daemon holds, and for how long one may take to ask.

A connection that never finishes its first request used to be held forever, with no cap:
2,000 of them at systemd's default limit of 1,024 open files left no descriptor for the
poller or for new clients, and asyncio's accept loop, retrying, spun a core and logged
48 MB in 20 s (issue: file-descriptor exhaustion).

Three rules, enforced where the descriptors are taken:

- At most ``limit`` connections, below the open-file limit by ``RESERVED_FDS`` for the
  poller, the state file, the uploader and the SDKs. The count is kept at ``accept()``
  (``ListeningSocket``): asyncio accepts a whole backlog in one pass, before any protocol
  sees a connection, so a cap applied in ``connection_made`` would come too late.
- Beyond the limit, a new connection closes the one that has waited longest without a
  request in progress (idle before its first request, in keep-alive, or still sending its
  headers). An honest client is the newest and asks at once, so it is served; requests
  in progress are never cut. Only when every connection has one is the newcomer refused.
- A request's headers must be complete within ``header_timeout`` of the connection (or,
  on a keep-alive connection, of the request's first byte); else the connection closes.

The HTTP protocol (the wiring's) reports each connection's state with ``started``,
``request_started``, ``request_done`` and ``lost``; this module imports nothing of uvicorn.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import resource
import socket
import time
from collections import deque
from typing import Any, Callable, Optional, Protocol

__all__ = [
    "HEADER_TIMEOUT_SECONDS",
    "MAX_CONNECTIONS",
    "RESERVED_FDS",
    "ConnectionGuard",
    "ListeningSocket",
    "connection_limit",
    "raise_open_file_limit",
]

log = logging.getLogger("sidecar.host.connections")

# Clients are training processes on this host or its containers: each holds one keep-alive
# connection per daemon URL. 1,024 is far beyond that; held idle, they cost about 5 MB.
MAX_CONNECTIONS = 1024
# Descriptors kept free of connections: the daemon uses under 10 at rest (7 polling the
# ESI API); the uploader up to two per part in flight (socket and file) plus inotify; the
# SDKs' pools a few each.
RESERVED_FDS = 128
# The soft limit start-up raises to, when the hard limit allows (LimitNOFILE= in the unit).
OPEN_FILES_WANTED = 8192
# Clients on this host send a request's headers in one write; 5 s is generous for a busy
# machine and short enough that idle connections never pile up.
HEADER_TIMEOUT_SECONDS = 5.0
# Connections closed at the limit keep their descriptor until the event loop's next pass:
# this many more may be accepted meanwhile (a burst is served in one pass, not one by one).
CLOSING_SLACK = 32
# An accepted socket whose protocol never started (asyncio failed to build its transport)
# stops counting after this long, so it cannot hold a slot for ever.
PENDING_SECONDS = 2.0
REFUSE_BATCH = 64  # refused per pass at most
REPORT_INTERVAL_SECONDS = 60.0
# What accept() raises when the process (or the system) is out of descriptors or memory.
OUT_OF_RESOURCES = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


def raise_open_file_limit(wanted: int = OPEN_FILES_WANTED) -> int:
    """Raise the soft RLIMIT_NOFILE towards ``wanted`` as far as the hard limit allows (an
    unprivileged process may); return the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(hard, wanted)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:  # a sandbox may refuse; the cap still fits
            log.warning("cannot raise the open-file limit from %d to %d: %s", soft, target, exc)
    return soft


def connection_limit(open_files: Optional[int] = None) -> int:
    """The most connections to hold at an open-file limit (default: the current soft one)."""
    if open_files is None:
        open_files = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if open_files == resource.RLIM_INFINITY:
        return MAX_CONNECTIONS
    return max(1, min(MAX_CONNECTIONS, max(open_files - RESERVED_FDS, open_files // 2)))


class Connection(Protocol):
    """What the guard needs of a connection: a way to drop it at once."""

    def close_now(self) -> None: ...


ACCEPT, FULL, WAIT = "accept", "full", "wait"


class ConnectionGuard:
    """The connections of one server: counted, ordered by how long they have waited, and
    timed while they owe a request. Runs on the event loop's thread only."""

    def __init__(self, limit: int, header_timeout: float = HEADER_TIMEOUT_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.limit = limit
        self.header_timeout = header_timeout
        self._clock = clock
        self._pending: deque[float] = deque()  # accepted, protocol not started yet
        self._open: set[Connection] = set()
        self._waiting: dict[Connection, None] = {}  # no request in progress, oldest first
        self._closing: set[Connection] = set()  # closed by us, descriptor freed next pass
        self._timers: dict[Connection, asyncio.TimerHandle] = {}
        self._paused = False
        # Totals, for tests and the log.
        self.evicted = 0
        self.refused = 0
        self.timed_out = 0
        self._reported = (0, 0)
        self._next_report = 0.0

    @property
    def open(self) -> int:
        return len(self._open)

    # -- accept() asks ---------------------------------------------------------------

    def admit(self) -> str:
        """Before an accept(): ACCEPT (there is room), FULL (make room for it, or refuse
        it), or WAIT for the event loop's next pass (descriptors of closed connections
        still held, or accepted connections not started yet)."""
        if self._paused:
            return WAIT
        now = self._clock()
        while self._pending and self._pending[0] < now - PENDING_SECONDS:
            self._pending.popleft()
        held = len(self._pending) + len(self._open)
        if held >= self.limit + CLOSING_SLACK:
            return WAIT
        if held - len(self._closing) < self.limit:
            return ACCEPT
        return FULL if self._waiting or not self._pending else WAIT

    def make_room(self) -> bool:
        """A connection was accepted at the limit: close the one that has waited longest
        without a request in progress. False when every connection has one."""
        for connection in self._waiting:
            self._close(connection)
            self.evicted += 1
            self._report()
            return True
        return False

    def accepted(self) -> None:
        self._pending.append(self._clock())

    def refused_one(self) -> None:
        self.refused += 1
        self._report()

    def pause_accepting(self) -> None:
        """Out of descriptors: accept nothing more in this pass of the event loop (asyncio
        tries once per connection in its backlog otherwise, logging each failure)."""
        self._paused = True
        asyncio.get_running_loop().call_soon(self._resume)

    def _resume(self) -> None:
        self._paused = False

    # -- the protocol reports ----------------------------------------------------------

    def started(self, connection: Connection) -> None:
        if self._pending:
            self._pending.popleft()
        self._open.add(connection)
        self._waiting[connection] = None
        self._arm(connection)

    def data_while_waiting(self, connection: Connection) -> None:
        """Bytes arrived and no request began: on a keep-alive connection they start the
        header clock (a request that arrives whole never arms a timer)."""
        if connection in self._waiting and connection not in self._timers:
            self._arm(connection)

    def request_started(self, connection: Connection) -> None:
        self._waiting.pop(connection, None)
        self._disarm(connection)

    def request_done(self, connection: Connection) -> None:
        """Answered; kept alive for the next request (uvicorn's keep-alive timeout)."""
        if connection in self._open and connection not in self._closing:
            self._waiting.pop(connection, None)
            self._waiting[connection] = None  # the newest again

    def lost(self, connection: Connection) -> None:
        self._open.discard(connection)
        self._waiting.pop(connection, None)
        self._closing.discard(connection)
        self._disarm(connection)

    # -- closing ---------------------------------------------------------------------

    def _close(self, connection: Connection) -> None:
        self._waiting.pop(connection, None)
        self._disarm(connection)
        self._closing.add(connection)
        connection.close_now()

    def _arm(self, connection: Connection) -> None:
        loop = asyncio.get_running_loop()
        self._timers[connection] = loop.call_later(self.header_timeout, self._expire, connection)

    def _disarm(self, connection: Connection) -> None:
        timer = self._timers.pop(connection, None)
        if timer is not None:
            timer.cancel()

    def _expire(self, connection: Connection) -> None:
        self._timers.pop(connection, None)
        if connection in self._waiting:
            self.timed_out += 1
            self._close(connection)

    def _report(self) -> None:
        """One warning when the limit is first reached, then at most one a minute."""
        now = self._clock()
        if now < self._next_report:
            return
        evicted, refused = self.evicted - self._reported[0], self.refused - self._reported[1]
        self._reported = (self.evicted, self.refused)
        self._next_report = now + REPORT_INTERVAL_SECONDS
        log.warning("at the limit of %d connections: closed %d that waited longest without "
                    "a request, refused %d (one such line a minute at most)", self.limit,
                    evicted, refused)


class ListeningSocket(socket.socket):
    """A listening socket whose ``accept()`` (called by asyncio's accept loop) asks the
    guard first. Raising BlockingIOError tells asyncio the backlog is empty for this pass:
    the listening socket stays readable, so the next pass asks again."""

    guard: Optional[ConnectionGuard] = None

    def accept(self) -> tuple[socket.socket, Any]:
        guard = self.guard
        if guard is None:
            return super().accept()
        verdict = guard.admit()
        if verdict == WAIT:
            raise BlockingIOError(errno.EAGAIN, "connection limit: wait for the next pass")
        # Room is made only for a connection really there: asyncio calls accept() once
        # more after the last one in its backlog.
        for _ in range(REFUSE_BATCH):
            try:
                connection, address = super().accept()
            except OSError as exc:
                if exc.errno in OUT_OF_RESOURCES:
                    guard.pause_accepting()
                raise
            if verdict == ACCEPT or guard.make_room():
                guard.accepted()
                return connection, address
            # Every connection is mid-request: refuse this one now (left in the backlog,
            # it would keep the socket readable and the loop spinning).
            connection.close()
            guard.refused_one()
        raise BlockingIOError(errno.EAGAIN, "connection limit: refused")
