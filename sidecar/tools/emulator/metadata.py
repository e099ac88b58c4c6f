"""What every fake instance metadata service shares: a threaded HTTP server on loopback,
injected faults, a request log, and a JSON control API under ``/_emulator/``.

    GET    /_emulator/state                       what the service would answer now
    POST   /_emulator/fault   {"kind": "status", "count": 3, "status": 503}
                              {"kind": "hang", "seconds": 5} | {"kind": "malformed"}
    DELETE /_emulator/fault                       clear the faults
    POST   /_emulator/clear                       withdraw every notice
    POST   /_emulator/<verb>  {...}               the cloud's own verbs (``control``)

A subclass answers the cloud's paths (``answer``), names its verbs (``control``) and says
what it holds (``describe``); it calls ``changed()`` after each change of its notices so
that long polls (GCP's ``wait_for_change``) wake. Standard library only.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Optional
from urllib.parse import parse_qsl, urlsplit

__all__ = ["FAULTS", "ControlError", "MetadataEmulator", "Reply", "number", "text"]

FAULTS = ("status", "hang", "malformed")
_MAX_BODY = 1 << 16
MALFORMED_BODY = "<html><body>Service Unavailable</body></html"


class ControlError(ValueError):
    """A control request that cannot be carried out: a 400 with this message."""


@dataclass
class Reply:
    status: int
    body: str = ""
    headers: dict[str, str] = field(default_factory=dict)
    content_type: str = "text/plain"


@dataclass
class _Fault:
    kind: str
    count: int
    status: int = 500
    seconds: float = 5.0


class MetadataEmulator:
    """Subclasses set ``service`` (a name for thread names and messages)."""

    service = "metadata"

    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._faults: list[_Fault] = []
        self._stopping = threading.Event()
        self._server: Optional[ThreadingHTTPServer] = None
        self.requests: list[tuple[str, str, int]] = []  # (method, path, status)

    # ------------------------------------------------------------------ for subclasses

    def answer(self, method: str, path: str, query: dict[str, str], headers: Any,
               body: bytes) -> Reply:
        raise NotImplementedError

    def control(self, verb: str, request: dict[str, Any]) -> None:
        """Carry out ``POST /_emulator/<verb>``; ControlError for a bad request."""
        raise ControlError(f"no control verb {verb!r}")

    def describe(self) -> dict[str, Any]:
        return {}

    def clear(self) -> None:
        """Withdraw every notice."""

    def changed(self) -> None:
        """Wake the requests that wait for a change. Call with ``self._lock`` held."""
        self._changed.notify_all()

    def wait_for_change(self, timeout: float, unchanged: Callable[[], bool]) -> None:
        """Block (``self._lock`` held) while ``unchanged()`` and time is left."""
        end = time.monotonic() + timeout
        while unchanged() and not self._stopping.is_set():
            left = end - time.monotonic()
            if left <= 0:
                return
            self._changed.wait(min(left, 0.2))

    # ------------------------------------------------------------------ faults

    def fail(self, kind: str, count: int = 1, *, status: int = 500,
             seconds: float = 5.0) -> None:
        """The next ``count`` requests to the cloud's paths: ``status`` (that HTTP error),
        ``hang`` (no answer for ``seconds``) or ``malformed`` (a 200 HTML page instead of
        the service's answer)."""
        if kind not in FAULTS:
            raise ValueError(f"unknown fault {kind!r}; choose from {', '.join(FAULTS)}")
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"count must be an integer >= 1, got {count!r}")
        if isinstance(status, bool) or not isinstance(status, int) or not 400 <= status <= 599:
            raise ValueError(f"status must be an HTTP error status (400-599), got {status!r}")
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not (
            0 <= seconds <= 600
        ):
            raise ValueError(f"seconds must be between 0 and 600, got {seconds!r}")
        with self._lock:
            self._faults.append(_Fault(kind, count, status, float(seconds)))

    def clear_faults(self) -> None:
        with self._lock:
            self._faults.clear()

    def request_count(self, path: Optional[str] = None) -> int:
        """Requests to the cloud's paths (``path`` without its query), control excluded."""
        with self._lock:
            return sum(1 for _m, p, _s in self.requests if path is None or p == path)

    def _take_fault(self) -> Optional[_Fault]:
        with self._lock:
            if not self._faults:
                return None
            fault = self._faults[0]
            fault.count -= 1
            if fault.count <= 0:
                self._faults.pop(0)
            return fault

    # ------------------------------------------------------------------ serving

    def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        if self._server is not None:
            raise RuntimeError(f"{self.service} emulator already started")
        self._stopping.clear()
        server = ThreadingHTTPServer((host, port), _Handler)
        server.daemon_threads = True
        server.emulator = self  # type: ignore[attr-defined]
        self._server = server
        threading.Thread(target=server.serve_forever, args=(0.05,),
                         name=f"{self.service}-emulator", daemon=True).start()
        return self.url

    @property
    def url(self) -> str:
        if self._server is None:
            raise RuntimeError(f"{self.service} emulator not started")
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def stop(self) -> None:
        """Stop serving, wake held requests, release the port. Safe to call twice."""
        server, self._server = self._server, None
        self._stopping.set()
        with self._lock:
            self._changed.notify_all()
        if server is not None:
            server.shutdown()
            server.server_close()

    def __enter__(self) -> Any:
        if self._server is None:
            self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def handle(self, method: str, target: str, headers: Any, body: bytes) -> Reply:
        url = urlsplit(target)
        if url.path.startswith("/_emulator/"):
            return self._handle_control(method, url.path, body)
        query = dict(parse_qsl(url.query, keep_blank_values=True))
        fault = self._take_fault()
        if fault is not None and fault.kind == "hang":
            self._stopping.wait(fault.seconds)
        if fault is not None and fault.kind == "status":
            reply = Reply(fault.status, "error")
        elif fault is not None and fault.kind == "malformed":
            # What a captive portal or a broken proxy answers instead of the service.
            reply = Reply(200, MALFORMED_BODY, content_type="text/html")
        else:
            reply = self.answer(method, url.path, query, headers, body)
        with self._lock:
            self.requests.append((method, url.path, reply.status))
        return reply

    def _handle_control(self, method: str, path: str, body: bytes) -> Reply:
        verb = path[len("/_emulator/"):].strip("/")
        if verb == "state" and method == "GET":
            return _json(200, self.state())
        if verb == "fault" and method == "DELETE":
            self.clear_faults()
            return _json(200, self.state())
        if method != "POST":
            return _json(405, {"error": f"use POST /_emulator/{verb}"})
        try:
            request = json.loads(body.decode("utf-8") or "{}")
        except (UnicodeDecodeError, ValueError) as exc:
            return _json(400, {"error": f"body is not JSON: {exc}"})
        if not isinstance(request, dict):
            return _json(400, {"error": "body must be a JSON object"})
        try:
            if verb == "fault":
                unknown = set(request) - {"kind", "count", "status", "seconds"}
                if unknown:
                    raise ControlError(f"unknown field(s) {sorted(unknown)}; use kind, "
                                       "count, status, seconds")
                self.fail(str(request.get("kind")), request.get("count", 1),
                          status=request.get("status", 500),
                          seconds=request.get("seconds", 5.0))
            elif verb == "clear":
                self.clear()
            else:
                self.control(verb, request)
        except (ControlError, ValueError, TypeError) as exc:
            status = 404 if str(exc).startswith("no control verb") else 400
            return _json(status, {"error": str(exc)})
        return _json(200, self.state())

    def state(self) -> dict[str, Any]:
        with self._lock:
            faults = [{"kind": f.kind, "count": f.count} for f in self._faults]
        return {"service": self.service, "faults": faults, "fault_kinds": list(FAULTS),
                **self.describe()}


def _json(status: int, body: Any) -> Reply:
    return Reply(status, json.dumps(body), content_type="application/json")


def number(request: dict[str, Any], key: str, default: Optional[float] = None) -> float:
    """A finite number from a control request, or ControlError naming it."""
    value = request.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or (
        value in (float("inf"), float("-inf"))
    ):
        raise ControlError(f"{key} must be a finite number, got {value!r}")
    return float(value)


def text(request: dict[str, Any], key: str, default: Optional[str] = None) -> str:
    value = request.get(key, default)
    if not isinstance(value, str) or not value:
        raise ControlError(f"{key} must be a non-empty string, got {value!r}")
    return value


class _Handler(BaseHTTPRequestHandler):
    server: Any
    protocol_version = "HTTP/1.1"
    # Keep-alive answers go out at once, not after a delayed ACK (~40 ms a request).
    disable_nagle_algorithm = True
    server_version = "esi-sidecar-emulator"
    sys_version = ""

    def do_GET(self) -> None:
        self._reply("GET")

    def do_PUT(self) -> None:
        self._reply("PUT")

    def do_POST(self) -> None:
        self._reply("POST")

    def do_DELETE(self) -> None:
        self._reply("DELETE")

    def _reply(self, method: str) -> None:
        emulator: MetadataEmulator = self.server.emulator
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = -1
        if not 0 <= length <= _MAX_BODY:
            reply = Reply(400, "bad Content-Length")
        else:
            body = self.rfile.read(length) if length else b""
            reply = emulator.handle(method, self.path, self.headers, body)
        data = reply.body.encode()
        try:
            self.send_response(reply.status)
            self.send_header("Content-Type", reply.content_type)
            for name, value in reply.headers.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up waiting (a hang fault, a long poll)

    def log_message(self, format: str, *args: Any) -> None:
        pass
