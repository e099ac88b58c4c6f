"""The sources' one home for the whole-request bound (issue 22): a cloud call's connect and
read timeouts bound each socket read, so an endpoint that trickles a byte every half
second would hold the source's poll forever and a real notice behind it would be missed.

Two ways to bound a request as a whole:

- :class:`Calls` runs a call (a urllib3 request, a botocore API call) in a thread and waits
  at most its bound; one that overruns is left to end by itself, and no new call under the
  same key starts until it has (at most one is ever left behind per key).
- :class:`Deadline` shuts the sockets it watches when the bound passes, so a read that
  waits wakes (a plain ``http.client`` connection: nothing is left behind).
"""

from __future__ import annotations

import contextlib
import socket
import threading
from typing import Any, Callable, Optional

from sidecar.host.sources.base import SourceError

__all__ = ["Calls", "Deadline", "Unfinished"]


class Unfinished(SourceError):
    """A bounded call that did not end in time, or whose previous one has not ended yet
    (told apart from a SourceError the call itself raised)."""


class Calls:
    """Calls bounded as a whole, each in a daemon thread; the one still running after its
    caller gave up on it is kept, by key, until it ends."""

    def __init__(self, thread_name: str) -> None:
        self._thread_name = thread_name
        self._lock = threading.Lock()
        self._pending: dict[str, threading.Thread] = {}

    def run(self, call: Callable[[], Any], seconds: float, *, key: str = "",
            busy: str, late: str) -> Any:
        """``call()``'s answer, or its exception raised here, when it ends within
        ``seconds``; else Unfinished(``late``). Unfinished(``busy``) without calling when
        the previous call under ``key`` has not ended yet."""
        outcome: dict[str, Any] = {}

        def run() -> None:
            try:
                outcome["answer"] = call()
            except Exception as exc:  # handed to the caller's thread
                outcome["error"] = exc

        with self._lock:
            previous = self._pending.get(key)
            if previous is not None and previous.is_alive():
                raise Unfinished(busy)
            worker = threading.Thread(target=run, name=self._thread_name, daemon=True)
            self._pending[key] = worker
        worker.start()
        worker.join(seconds)
        if worker.is_alive():
            raise Unfinished(late)
        if "error" in outcome:
            raise outcome["error"]
        return outcome.get("answer")


class Deadline:
    """A timer started on entry that, ``seconds`` later, sets :attr:`expired` and shuts
    every socket handed to :meth:`watch` (the response keeps reading the socket after its
    connection lets it go, so it is shut, not closed); cancelled on exit."""

    def __init__(self, seconds: float) -> None:
        self.expired = threading.Event()
        self._sockets: list[socket.socket] = []
        self._timer = threading.Timer(seconds, self._cut)
        self._timer.daemon = True

    def watch(self, sock: Optional[socket.socket]) -> None:
        if sock is not None:
            self._sockets.append(sock)

    def _cut(self) -> None:
        self.expired.set()
        for sock in self._sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def __enter__(self) -> Deadline:
        self._timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._timer.cancel()
