"""One daemon's HTTP endpoint, every request bounded in time (standard library only).

The training loop asks through :class:`Endpoint`: a whole request (connect, send, every
byte of the answer) ends within the client's timeout, however slowly a broken daemon
answers; a failure is a :class:`FetchError` with one line saying why.
"""

from __future__ import annotations

import http.client
import io
import ipaddress
import json
import math
import socket
import time
import urllib.parse
from contextlib import suppress
from typing import Any, Optional

from sidecar.models import Expiry

__all__ = ["ENV_TOKEN", "EXPIRY_PATH", "Endpoint", "FetchError", "describe_error"]

# The daemon's token, sent as "Authorization: Bearer ..." when set: a daemon listening
# beyond loopback (a container on a bridge network) requires it; loopback needs none.
ENV_TOKEN = "ESI_SIDECAR_TOKEN"
EXPIRY_PATH = "/v1/expiry"
# /v1/expiry is a few hundred bytes; anything much larger is not our daemon.
_MAX_BODY_BYTES = 64 * 1024
_USER_AGENT = "esi-sidecar-client"
_JSON_BODY = {"Content-Type": "application/json"}
_TCP_QUICKACK: Optional[int] = getattr(socket, "TCP_QUICKACK", None)  # Linux only


class FetchError(Exception):
    """One failed request; the message is one line naming the URL."""

    def __init__(self, message: str, status: Optional[int] = None) -> None:
        super().__init__(message)
        self.status = status  # the HTTP status of an answer that was not a success


def describe_error(exc: BaseException, timeout: float) -> str:
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


class Endpoint:
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
        """GET ``path`` and decode JSON; raises FetchError with a one-line message.

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
                raise FetchError(f"{self.url}: {describe_error(exc, self._timeout)}") from None
            if len(body) > _MAX_BODY_BYTES or not response.isclosed() or response.will_close:
                self.close()  # unread bytes or a closing peer: do not reuse
            if len(body) > _MAX_BODY_BYTES:
                raise FetchError(f"{self.url}: response larger than {_MAX_BODY_BYTES} bytes")
            if response.status == 401:
                wanted = "a token" if "Authorization" not in self._headers else "another token"
                raise FetchError(f"{self.url}: HTTP 401 from {path}: the daemon wants {wanted} "
                                  f"(set {ENV_TOKEN} to the daemon's)")
            if response.status != 200 and not (method == "POST" and response.status == 202):
                raise FetchError(f"{self.url}: HTTP {response.status} from {path}",
                                  response.status)
            try:
                return json.loads(body.decode("utf-8"))
            except ValueError as exc:
                raise FetchError(f"{self.url}: malformed JSON ({exc})") from None
        raise AssertionError("unreachable")  # pragma: no cover

    def expiry(self) -> Expiry:
        body = self.get_json(EXPIRY_PATH)
        try:
            return Expiry.from_json(body)
        except ValueError as exc:
            raise FetchError(f"{self.url}: bad {EXPIRY_PATH} body ({exc})") from None
