"""The job events' background sender: fire-and-forget posts to one daemon (stdlib only).

A guard's ``send_event()`` is a queue put; one thread, started by the first event and gone
after 30 s idle, posts them one request at a time (docs/events.md).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import threading
from collections import deque
from typing import Any, Optional

from sidecar.train.endpoint import Endpoint, FetchError, describe_error

__all__ = ["EVENTS_PATH", "EventSender"]

logger = logging.getLogger("sidecar.train.client")

EVENTS_PATH = "/v1/events"
# The events waiting for the sender: a guard queues a few per save and one per 30 s, so
# this many mean the daemon has not answered for a long while; the oldest go first.
MAX_QUEUED_EVENTS = 256
MAX_EVENTS_PER_REQUEST = 50  # the daemon takes up to 100
EVENT_RETRY_SECONDS = 5.0  # after a failed request, as the deadline's retry
EVENT_IDLE_SECONDS = 30.0  # the sender's thread ends after this long without events
_NO_EVENTS_ENDPOINT = (404, 405)  # a daemon older than /v1/events


class EventSender:
    """Posts job events to one daemon from one background thread, so that the training
    loop never waits for it: :meth:`put` only appends to a bounded queue (dropping the
    oldest when full). One request at a time, each within the client's timeout; a failed
    request drops its events (never sent twice) and the next waits EVENT_RETRY_SECONDS.
    The thread starts with the first event and ends after EVENT_IDLE_SECONDS without one;
    :meth:`close` (and the interpreter's exit) sends what is queued, within two timeouts.
    Every count is the sender's own; nothing here raises."""

    def __init__(self, url: str, timeout: float, token: Optional[str]) -> None:
        self.url, self._timeout, self._token = url, timeout, token
        self._lock = threading.Lock()
        self._queue: deque[dict[str, Any]] = deque()
        self._wake = threading.Event()
        self._closing = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._pid = os.getpid()
        self._disabled = False  # the daemon has no /v1/events
        self._failing: Optional[str] = None  # for logging once per change
        self._at_exit = False
        self.sent = 0
        self.dropped = 0
        self.last_error: Optional[str] = None

    def put(self, event: dict[str, Any]) -> None:
        start: Optional[threading.Thread] = None
        with self._lock:
            if self._pid != os.getpid():  # a forked child: the thread stayed in the parent
                self._pid, self._thread = os.getpid(), None
                self._queue.clear()
            if self._disabled:
                self.dropped += 1
                return
            if len(self._queue) >= MAX_QUEUED_EVENTS:
                self._queue.popleft()
                self.dropped += 1
            self._queue.append(event)
            if self._thread is None:
                self._closing.clear()
                start = self._thread = threading.Thread(
                    target=self._run, name="esi-sidecar-events", daemon=True)
        if start is not None:
            try:
                start.start()
            except RuntimeError:  # no thread to be had: the events wait for a later try
                with self._lock:
                    self._thread = None
                return
            if not self._at_exit:  # what is queued when the job ends is still sent
                self._at_exit = True
                atexit.register(self.close)
        if not self._wake.is_set():  # set() takes a lock; the thread may be awake already
            self._wake.set()

    def _take(self) -> Optional[list[dict[str, Any]]]:
        """The next batch; None (and the thread forgotten) when there is nothing to send."""
        with self._lock:
            if not self._queue:
                self._thread = None
                return None
            return [self._queue.popleft()
                    for _ in range(min(len(self._queue), MAX_EVENTS_PER_REQUEST))]

    def _run(self) -> None:
        endpoint = Endpoint(self.url, self._timeout, self._token)
        try:
            while True:
                with self._lock:
                    idle = not self._queue
                if idle and not self._closing.is_set() and self._wake.wait(EVENT_IDLE_SECONDS):
                    self._wake.clear()
                    continue  # look again: the wake may be for events already sent
                batch = self._take()  # None after a wait without events: the thread ends
                if batch is None:
                    return
                if not self._send(endpoint, batch) and not self._closing.is_set():
                    self._closing.wait(EVENT_RETRY_SECONDS)
                if self._closing.is_set() and self.last_error is not None:
                    with self._lock:  # closing and failing: what is left is dropped
                        self.dropped += len(self._queue)
                        self._queue.clear()
                        self._thread = None
                    return
        except Exception:  # a bug of ours must not print into the training job's output
            with self._lock:
                self._thread = None
        finally:
            endpoint.close()

    def _send(self, endpoint: Endpoint, batch: list[dict[str, Any]]) -> bool:
        try:
            body = json.dumps(batch, separators=(",", ":"), allow_nan=False).encode()
            endpoint.request_json("POST", EVENTS_PATH, body)
        except Exception as exc:
            status = getattr(exc, "status", None)
            why = str(exc) if isinstance(exc, FetchError) else describe_error(exc, 0)
            with self._lock:
                self.dropped += len(batch)
                self.last_error = why
                if status in _NO_EVENTS_ENDPOINT:
                    self._disabled = True
                    self.dropped += len(self._queue)
                    self._queue.clear()
            if status in _NO_EVENTS_ENDPOINT:
                logger.info("the daemon at %s takes no job events (%s): not sending them",
                            self.url, why)
            elif self._failing != why:
                self._failing = why
                logger.info("job events to %s failed (%s); dropping them until one goes "
                            "through", self.url, why)
            return False
        with self._lock:
            self.sent += len(batch)
            self.last_error = None
        if self._failing is not None:
            self._failing = None
            logger.info("job events reach %s again", self.url)
        return True

    def close(self) -> None:
        """Send what is queued (within two timeouts) and stop the thread."""
        with self._lock:
            thread = self._thread
        self._closing.set()
        self._wake.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join(2 * self._timeout + 0.05)
        if self._at_exit:
            self._at_exit = False
            atexit.unregister(self.close)
