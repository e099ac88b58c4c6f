"""The training side's HTTP client for the daemon (standard library only).

``pip install esi-sidecar`` must work in any training image, and a test fails if
importing this module pulls in a server dependency.

:class:`SidecarClient` asks one or more daemons for the deadline (``GET /v1/expiry``) and
whether a checkpoint is durable (``GET /v1/uploads``). It never raises into the training
loop because the daemon is down, slow or talking nonsense: it answers None and records
``last_error``. What to do with the answer (cache, fallback, the decision) lives in
:mod:`sidecar.train.deadline` and :mod:`sidecar.train.guard`.
"""

from __future__ import annotations

import atexit
import http.client
import io
import ipaddress
import json
import logging
import math
import os
import socket
import threading
import time
import urllib.parse
from collections import deque
from collections.abc import Mapping, Sequence
from contextlib import suppress
from dataclasses import replace
from typing import Any, Optional, Union

from sidecar.models import DEFAULT_LISTEN, Expiry

__all__ = ["DEFAULT_TIMEOUT_SECONDS", "DEFAULT_URL", "ENV_TOKEN", "ENV_URL", "SidecarClient"]

logger = logging.getLogger("sidecar.train.client")

DEFAULT_URL = f"http://{DEFAULT_LISTEN}"
# Short: the client is asked from the training loop; on loopback the daemon answers in
# about a millisecond.
DEFAULT_TIMEOUT_SECONDS = 0.2
ENV_URL = "ESI_SIDECAR_URL"
# The daemon's token, sent as "Authorization: Bearer ..." when set: a daemon listening
# beyond loopback (a container on a bridge network) requires it; loopback needs none.
ENV_TOKEN = "ESI_SIDECAR_TOKEN"
EXPIRY_PATH = "/v1/expiry"
UPLOADS_PATH = "/v1/uploads?limit=0"  # the summary only: last_durable_step
# /v1/expiry is a few hundred bytes; anything much larger is not our daemon.
_MAX_BODY_BYTES = 64 * 1024
_USER_AGENT = "esi-sidecar-client"
_JSON_BODY = {"Content-Type": "application/json"}
_TCP_QUICKACK: Optional[int] = getattr(socket, "TCP_QUICKACK", None)  # Linux only


# ---------------------------------------------------------------------------- HTTP client


class _FetchError(Exception):
    """One failed request; the message is one line naming the URL."""

    def __init__(self, message: str, status: Optional[int] = None) -> None:
        super().__init__(message)
        self.status = status  # the HTTP status of an answer that was not a success


def _describe_error(exc: BaseException, timeout: float) -> str:
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return f"no answer within {timeout:g} s"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class _Deadline:
    """The end of one request (connect, send, headers and body together): every socket
    wait gets only what is left of it, so a daemon that trickles its answer a byte at a
    time cannot stretch a 0.2 s timeout into a minute."""

    def __init__(self) -> None:
        self.at = math.inf  # time.monotonic()

    def left(self) -> float:
        left = self.at - time.monotonic()
        if left <= 0:
            raise socket.timeout("timed out")
        return left


class _BoundedReader(io.RawIOBase):
    """What ``http.client`` reads the response from: ``recv_into`` within the deadline.

    It reads through the socket's own ``makefile()``, which keeps the descriptor open
    until the response is read: ``http.client`` closes the connection as soon as the
    headers say ``Connection: close`` (an HTTP/1.0 peer), before the body is read."""

    def __init__(self, sock: socket.socket, deadline: _Deadline) -> None:
        super().__init__()
        self._sock = sock
        self._raw = sock.makefile("rb", buffering=0)
        self._deadline = deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        self._sock.settimeout(self._deadline.left())
        return self._raw.readinto(buffer) or 0

    def close(self) -> None:
        self._raw.close()
        super().close()


class _BoundedSocket:
    """The connection's socket as ``http.client`` sees it: sends and reads bounded by the
    request's deadline; everything else goes to the real socket."""

    def __init__(self, sock: socket.socket, deadline: _Deadline) -> None:
        self._sock = sock
        self._deadline = deadline

    def makefile(self, mode: str = "rb", *args: Any, **kwargs: Any) -> io.BufferedReader:
        return io.BufferedReader(_BoundedReader(self._sock, self._deadline))

    def sendall(self, data: bytes, *args: Any) -> None:
        self._sock.settimeout(self._deadline.left())
        self._sock.sendall(data, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _Endpoint:
    """One daemon URL with its keep-alive connection (reopened after any failure)."""

    def __init__(self, url: str, timeout: float, token: Optional[str] = None) -> None:
        parts = urllib.parse.urlsplit(url.strip())
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http:// URL: {url!r}")
        try:
            port = parts.port
        except ValueError:
            raise ValueError(f"bad port in URL: {url!r}") from None
        self.url = url.strip().rstrip("/")
        self._https = parts.scheme == "https"
        self._host = parts.hostname
        self._port = port or (443 if self._https else 80)
        self._base_path = parts.path.rstrip("/")
        self.on_loopback = _is_loopback(self._host)
        self._timeout = timeout
        self._deadline = _Deadline()
        self._connection: Optional[http.client.HTTPConnection] = None
        self._headers = {"Accept": "application/json", "User-Agent": _USER_AGENT}
        if token is not None:
            self._headers["Authorization"] = f"Bearer {token}"
        # The last answer that carried a deadline; forgotten only when the daemon says,
        # freshly, that none is scheduled (see SidecarClient.expiry).
        self.known: Optional[Expiry] = None

    def close(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None

    def _connect(self) -> http.client.HTTPConnection:
        factory = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
        connection = factory(self._host, self._port, timeout=self._deadline.left())
        connection.connect()
        connection.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        connection.sock = _BoundedSocket(connection.sock, self._deadline)
        return connection

    def _quick_ack(self, connection: http.client.HTTPConnection) -> None:
        """Ask Linux to ACK the reply at once instead of after up to 40 ms.

        A server that writes headers and body separately without TCP_NODELAY holds the
        body until the first part is acknowledged; with a delayed ACK, each keep-alive
        request then takes about 44 ms instead of 0.5 ms (measured against the daemon).
        The flag is not sticky, so it is set around every request. No-op elsewhere.
        """
        if _TCP_QUICKACK is not None and connection.sock is not None:
            with suppress(OSError):
                connection.sock.setsockopt(socket.IPPROTO_TCP, _TCP_QUICKACK, 1)

    def get_json(self, path: str) -> Any:
        """GET ``path`` and decode JSON; raises _FetchError with a one-line message.

        The whole request, a retry on a fresh connection included, ends within the
        client's timeout."""
        return self.request_json("GET", path)

    def request_json(self, method: str, path: str, body: Optional[bytes] = None) -> Any:
        """``method`` ``path`` (with a JSON ``body``) and decode the JSON answer, as
        :meth:`get_json`; a POST may be answered 200 or 202."""
        self._deadline.at = time.monotonic() + self._timeout
        headers = self._headers if body is None else {**self._headers, **_JSON_BODY}
        for _attempt in range(2):
            reused = self._connection is not None
            try:
                connection = self._connection or self._connect()
                self._connection = connection
                self._quick_ack(connection)
                connection.request(
                    method,
                    self._base_path + path,
                    body=body,
                    headers=headers,
                )
                self._quick_ack(connection)
                response = connection.getresponse()
                body = response.read(_MAX_BODY_BYTES + 1)
            except Exception as exc:
                self.close()
                timed_out = isinstance(exc, (socket.timeout, TimeoutError))
                if reused and not timed_out:
                    # The peer closed an idle keep-alive connection (a restart, its
                    # keep-alive timeout): one retry on a fresh connection. Never after a
                    # timeout, which would double the stall in the training loop.
                    continue
                raise _FetchError(f"{self.url}: {_describe_error(exc, self._timeout)}") from None
            if len(body) > _MAX_BODY_BYTES or not response.isclosed() or response.will_close:
                self.close()  # unread bytes or a closing peer: do not reuse
            if len(body) > _MAX_BODY_BYTES:
                raise _FetchError(f"{self.url}: response larger than {_MAX_BODY_BYTES} bytes")
            if response.status == 401:
                wanted = "a token" if "Authorization" not in self._headers else "another token"
                raise _FetchError(f"{self.url}: HTTP 401 from {path}: the daemon wants {wanted} "
                                  f"(set {ENV_TOKEN} to the daemon's)")
            if response.status != 200 and not (method == "POST" and response.status == 202):
                raise _FetchError(f"{self.url}: HTTP {response.status} from {path}",
                                  response.status)
            try:
                return json.loads(body.decode("utf-8"))
            except ValueError as exc:
                raise _FetchError(f"{self.url}: malformed JSON ({exc})") from None
        raise AssertionError("unreachable")  # pragma: no cover

    def expiry(self) -> Expiry:
        body = self.get_json(EXPIRY_PATH)
        try:
            return Expiry.from_json(body)
        except ValueError as exc:
            raise _FetchError(f"{self.url}: bad {EXPIRY_PATH} body ({exc})") from None


# ---------------------------------------------------------------------------- job events

EVENTS_PATH = "/v1/events"
# The events waiting for the sender: a guard queues a few per save and one per 30 s, so
# this many mean the daemon has not answered for a long while; the oldest go first.
MAX_QUEUED_EVENTS = 256
MAX_EVENTS_PER_REQUEST = 50  # the daemon takes up to 100
EVENT_RETRY_SECONDS = 5.0  # after a failed request, as the deadline's retry
EVENT_IDLE_SECONDS = 30.0  # the sender's thread ends after this long without events
_NO_EVENTS_ENDPOINT = (404, 405)  # a daemon older than /v1/events


class _EventSender:
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
        endpoint = _Endpoint(self.url, self._timeout, self._token)
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

    def _send(self, endpoint: _Endpoint, batch: list[dict[str, Any]]) -> bool:
        try:
            body = json.dumps(batch, separators=(",", ":"), allow_nan=False).encode()
            endpoint.request_json("POST", EVENTS_PATH, body)
        except Exception as exc:
            status = getattr(exc, "status", None)
            why = str(exc) if isinstance(exc, _FetchError) else _describe_error(exc, 0)
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


def _kept(known: Expiry, why: str) -> Expiry:
    """A daemon's last answer with a deadline, served again because it said nothing newer."""
    remaining = None if known.expires_at_unix is None else known.expires_at_unix - time.time()
    return replace(
        known, stale=True, error=f"last known deadline kept; {why}", remaining_seconds=remaining
    )


def _with_slowest_upload(chosen: Expiry, answers: list[Expiry]) -> Expiry:
    """The slowest node's upload counts (every node's checkpoint must be durable; a node
    that stopped answering counts with its last answer), and any node's uploader in
    trouble makes the whole answer say so."""
    estimates = [a.upload_seconds for a in answers if a.upload_seconds is not None]
    states = [a.upload_status for a in answers if a.upload_status is not None]
    status = next((s for s in ("degraded", "uploading", "ok") if s in states), None)
    return replace(chosen, upload_seconds=max(estimates) if estimates else None,
                   upload_status=status)


def _check_token(token: str) -> str:
    """A token fit for one header line: printable ASCII without spaces, else ValueError
    (which never shows the token itself)."""
    if not isinstance(token, str) or not token or not all(33 <= ord(c) <= 126 for c in token):
        raise ValueError("token must be non-empty printable ASCII without spaces")
    return token


def _token_from_environment() -> Optional[str]:
    value = os.environ.get(ENV_TOKEN, "").strip()
    if not value:
        return None
    try:
        return _check_token(value)
    except ValueError as exc:
        # Outside data: never crash the training loop on it; the daemon will say 401.
        logger.warning("ignoring %s: %s", ENV_TOKEN, exc)
        return None


def _split_urls(value: str) -> list[str]:
    return [part.strip() for part in value.split(",") if part.strip()]


class SidecarClient:
    """Asks one or more daemons for the deadline; never raises on network or data errors.

    ``url``: a URL, a comma-separated list or a sequence of URLs; default
    ``$ESI_SIDECAR_URL``, else ``http://127.0.0.1:8791``. With several (one daemon per
    node), the earliest deadline wins. Each URL keeps one keep-alive connection, so a
    refresh costs one round trip on loopback, and a short ``timeout`` (0.2 s) bounds
    the stall when a daemon hangs. ``http.client`` reads no proxy variables, so an
    ``http_proxy`` set for downloads never captures loopback traffic.

    ``token``: sent as ``Authorization: Bearer <token>`` to every daemon; default
    ``$ESI_SIDECAR_TOKEN`` (unset: none). A daemon listening beyond loopback requires it
    (docs/deploy.md, "Containers"); on loopback none is needed.

    Not thread-safe: use one client per thread.
    """

    def __init__(
        self, url: Union[str, Sequence[str], None] = None,
        timeout: float = DEFAULT_TIMEOUT_SECONDS,
        token: Optional[str] = None,
    ) -> None:
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, (int, float))
            or not (math.isfinite(timeout) and timeout > 0)
        ):
            raise ValueError(f"timeout must be a number of seconds > 0, got {timeout!r}")
        self.timeout = float(timeout)
        if token is not None:
            # The caller's own argument: refuse a bad one here, at start-up.
            self._token: Optional[str] = _check_token(token)
        else:
            self._token = _token_from_environment()
        if url is not None:
            urls = _split_urls(url) if isinstance(url, str) else [u.strip() for u in url]
            if not urls:
                raise ValueError(f"url names no daemon: {url!r}")
            # The caller's own argument: a typo should fail here, at start-up.
            self._endpoints = [_Endpoint(u, self.timeout, self._token) for u in urls]
        else:
            self._endpoints = self._endpoints_from_environment()
        self.last_error: Optional[str] = None
        # URLs whose part of the last expiry() was not a current deadline (no answer, or a
        # stale answer without one): the caller should take the result as last known.
        self.degraded_urls: tuple[str, ...] = ()
        self._failing: tuple[str, ...] = ()  # for logging once per change
        self._warned_partial = False
        self._events: Optional[_EventSender] = None  # started by the first send_event()

    def _endpoints_from_environment(self) -> list[_Endpoint]:
        endpoints = []
        for candidate in _split_urls(os.environ.get(ENV_URL, "")):
            try:
                endpoints.append(_Endpoint(candidate, self.timeout, self._token))
            except ValueError as exc:
                # The environment is outside data: never crash the training loop on it.
                logger.warning("ignoring %s entry: %s", ENV_URL, exc)
        return endpoints or [_Endpoint(DEFAULT_URL, self.timeout, self._token)]

    @property
    def urls(self) -> tuple[str, ...]:
        return tuple(endpoint.url for endpoint in self._endpoints)

    def expiry(self) -> Optional[Expiry]:
        """``GET /v1/expiry`` from every URL; the answer with the earliest deadline.

        None when no daemon answered properly; ``last_error`` then says why (one line
        per failed URL, joined by "; "). ``last_error`` is also set when some URLs
        answered and others did not (logged once per change of the failing set), and is
        None when all answered.

        Each URL's last deadline is kept while that daemon gives nothing newer: while it
        fails, and while it answers stale without a deadline (a daemon restarted without
        its state file while the cloud API fails). A node that stops answering is still
        released on time, so its deadline stays in the MIN. Such a kept deadline comes
        back as that daemon's last answer marked ``stale``, with ``error`` saying why,
        and its URL is listed in ``degraded_urls``. A fresh answer without a deadline
        ("nothing scheduled") forgets it.
        """
        answered: list[Expiry] = []
        candidates: list[Expiry] = []
        errors: list[str] = []
        failing: list[str] = []
        degraded: list[str] = []
        for endpoint in self._endpoints:
            try:
                answer = endpoint.expiry()
            except _FetchError as exc:
                why = str(exc)
            except Exception as exc:  # never into the training loop, whatever it was
                endpoint.close()
                why = f"{endpoint.url}: {_describe_error(exc, self.timeout)}"
            else:
                answered.append(answer)
                if answer.expires_at_unix is not None:
                    endpoint.known = answer
                elif not answer.stale:
                    endpoint.known = None  # the daemon says, freshly: nothing scheduled
                else:
                    degraded.append(endpoint.url)
                    if endpoint.known is not None:
                        reason = f"stale answer without a deadline ({answer.error})"
                        candidates.append(_kept(endpoint.known, f"{endpoint.url}: {reason}"))
                        continue
                candidates.append(answer)
                continue
            errors.append(why)
            failing.append(endpoint.url)
            degraded.append(endpoint.url)
            if endpoint.known is not None:
                candidates.append(_kept(endpoint.known, why))
        self.last_error = "; ".join(errors) or None
        self.degraded_urls = tuple(degraded)
        self._log_failing(tuple(failing), any_answered=bool(answered))
        if not answered:
            return None
        with_deadline = [a for a in candidates if a.expires_at_unix is not None]
        if with_deadline:
            chosen = min(with_deadline, key=lambda a: a.expires_at_unix or 0.0)
        else:
            chosen = next((a for a in answered if a.stale), answered[0])
        if len(self._endpoints) < 2:
            return chosen
        return _with_slowest_upload(chosen, [*answered, *candidates])

    def _log_failing(self, failing: tuple[str, ...], *, any_answered: bool) -> None:
        """One line per change of the set of daemons that do not answer, while others do.

        When none answers, the caller (the guard) says so; with a single URL there is no
        partial failure.
        """
        if failing == self._failing or len(self._endpoints) < 2:
            return
        self._failing = failing
        if not any_answered:
            self._warned_partial = False  # "unreachable" is the caller's to say
        elif failing:
            self._warned_partial = True
            logger.warning(
                "no answer from %d of %d sidecar daemons (%s); keeping the last known"
                " deadline of each",
                len(failing),
                len(self._endpoints),
                self.last_error,
            )
        elif self._warned_partial:
            self._warned_partial = False
            logger.info("every sidecar daemon answers again (%s)", ", ".join(self.urls))

    def deadline_unix(self) -> Optional[float]:
        """The earliest ``expires_at_unix`` across the daemons, or None (none / no answer)."""
        answer = self.expiry()
        return None if answer is None else answer.expires_at_unix

    def _durable_steps(self) -> Optional[list[Optional[int]]]:
        """``last_durable_step`` of every daemon that uploads (``GET /v1/uploads``); None
        when any daemon did not answer properly (``last_error`` says why)."""
        steps: list[Optional[int]] = []
        errors: list[str] = []
        for endpoint in self._endpoints:
            try:
                body = endpoint.get_json(UPLOADS_PATH)
                if not isinstance(body, dict):
                    raise _FetchError(f"{endpoint.url}: bad {UPLOADS_PATH} body")
                if not body.get("enabled"):
                    continue
                step = body.get("last_durable_step")
                if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
                    raise _FetchError(f"{endpoint.url}: bad last_durable_step {step!r}")
                steps.append(step)
            except _FetchError as exc:
                errors.append(str(exc))
            except Exception as exc:  # never into the training loop, whatever it was
                endpoint.close()
                errors.append(f"{endpoint.url}: {_describe_error(exc, self.timeout)}")
        self.last_error = "; ".join(errors) or None
        return None if errors else steps

    def last_durable_step(self) -> Optional[int]:
        """The step of the newest checkpoint the daemon's uploader made durable in storage
        (its remote manifest is written). Never raises.

        With several daemons (one per node, each uploading its own files), the smallest
        among those that upload: a step is durable only when every node's part is. None
        when nothing is durable yet, no daemon uploads, or a daemon did not answer.
        """
        steps = self._durable_steps()
        if not steps or any(step is None for step in steps):
            return None
        return min(step for step in steps if step is not None)

    def is_durable(self, step: int) -> Optional[bool]:
        """Is a checkpoint at ``step`` or newer durable in storage? Never raises.

        True or False when the uploader(s) answered; None when unknown (no daemon
        uploads, or one did not answer). Once a newer checkpoint is durable the uploader
        skips older ones, so this asks "is my progress up to ``step`` safe", not "was
        that exact folder uploaded".
        """
        steps = self._durable_steps()
        if not steps:
            return None
        if any(durable is None for durable in steps):
            return False
        return min(durable for durable in steps if durable is not None) >= step

    def send_event(self, event: Mapping[str, Any]) -> None:
        """Queue a job event for this node's daemon (``POST /v1/events``) and return at
        once: a background thread sends it, one request at a time within ``timeout``, so
        a slow or dead daemon never delays the caller. Never raises; an event that cannot
        be sent is dropped and counted in :attr:`events_dropped`. Safe from any thread.

        One daemon gets the events, this node's own: the first URL on loopback, else
        the first URL (list this node's daemon first). Its history is this node's; with
        several daemons the others are still asked for their deadlines, as before."""
        try:
            sender = self._events
            if sender is None:
                own = next((e for e in self._endpoints if e.on_loopback), self._endpoints[0])
                sender = self._events = _EventSender(own.url, self.timeout, self._token)
            sender.put(dict(event))
        except Exception:  # never into the training loop, whatever it was
            pass

    @property
    def events_sent(self) -> int:
        """Events the daemon accepted (202) so far."""
        return 0 if self._events is None else self._events.sent

    @property
    def events_dropped(self) -> int:
        """Events never sent: the queue was full, the request failed, or the daemon has no
        ``/v1/events``."""
        return 0 if self._events is None else self._events.dropped

    def close(self) -> None:
        """Close the connections; send the queued events first (within two timeouts)."""
        if self._events is not None:
            self._events.close()
        for endpoint in self._endpoints:
            endpoint.close()

    def __enter__(self) -> SidecarClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SidecarClient(url={','.join(self.urls)!r}, timeout={self.timeout!r})"
