"""A fake EC2 instance metadata service (IMDS) speaking its wire format, for the aws source.

    PUT /latest/api/token                        X-aws-ec2-metadata-token-ttl-seconds: 1-21600
    GET /latest/meta-data/instance-id            X-aws-ec2-metadata-token: <token>
    GET /latest/meta-data/spot/instance-action   404, or {"action": ..., "time": ...}
    GET /latest/meta-data/events/maintenance/scheduled          [] or a list of events
    GET /latest/meta-data/events/recommendations/rebalance      404, or {"noticeTime": ...}

As the real one: tokens are opaque, expire after their TTL, and a GET without a valid
token is a 401 (unless ``imdsv1=True``, a host that still allows IMDSv1); a PUT without
the TTL header, or with one out of range, is a 400. Times are written as EC2 writes them
("2026-12-01T08:22:00Z"; maintenance "21 Jan 2019 09:00:43 GMT").

The test side is a Python API: :meth:`interrupt`, :meth:`schedule_maintenance`,
:meth:`recommend_rebalance`, :meth:`clear`, :meth:`expire_tokens`, and faults
(:meth:`fail`: an HTTP status, a hang or a malformed body for the next N requests).
Standard library only; ``start()`` serves on a daemon thread.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from email.utils import format_datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Optional

__all__ = ["AwsImdsEmulator"]

TOKEN_PATH = "/latest/api/token"
_PATHS = {
    "/latest/meta-data/instance-id",
    "/latest/meta-data/spot/instance-action",
    "/latest/meta-data/events/maintenance/scheduled",
    "/latest/meta-data/events/recommendations/rebalance",
}


@dataclass
class _Fault:
    kind: str  # "status", "hang" or "malformed"
    count: int
    status: int = 500
    seconds: float = 0.0


def _iso(unix: float) -> str:
    return datetime.fromtimestamp(unix, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _maintenance_date(unix: float) -> str:
    # EC2 writes "21 Jan 2019 09:00:43 GMT" (RFC 1123 without the weekday).
    return format_datetime(datetime.fromtimestamp(unix, timezone.utc), usegmt=True)[5:]


class AwsImdsEmulator:
    def __init__(
        self,
        instance_id: str = "i-0123456789abcdef0",
        *,
        imdsv1: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.instance_id = instance_id
        self.imdsv1 = imdsv1
        self._clock = clock
        self._lock = threading.Lock()
        self._tokens: dict[str, float] = {}  # token -> expiry (clock)
        self._spot: Optional[dict[str, str]] = None
        self._maintenance: list[dict[str, str]] = []
        self._rebalance: Optional[dict[str, str]] = None
        self._faults: list[_Fault] = []
        self._stopping = threading.Event()
        self.token_requests = 0
        self.requests: list[tuple[str, str, int]] = []  # (method, path, status)
        self._server: Optional[ThreadingHTTPServer] = None

    # ------------------------------------------------------------------ control

    def interrupt(self, at_unix: float, action: str = "terminate") -> None:
        """A spot interruption notice: the instance goes at ``at_unix``."""
        with self._lock:
            self._spot = {"action": action, "time": _iso(at_unix)}

    def schedule_maintenance(self, not_before_unix: float, code: str = "system-reboot",
                             state: str = "active") -> None:
        with self._lock:
            self._maintenance.append({
                "NotBefore": _maintenance_date(not_before_unix),
                "Code": code,
                "Description": "scheduled reboot",
                "EventId": f"instance-event-{len(self._maintenance):017d}",
                "NotAfter": _maintenance_date(not_before_unix + 7200),
                "State": state,
            })

    def recommend_rebalance(self, at_unix: float) -> None:
        with self._lock:
            self._rebalance = {"noticeTime": _iso(at_unix)}

    def set_raw(self, path: str, body: str) -> None:
        """Serve ``body`` verbatim at a notice path (a malformed notice)."""
        with self._lock:
            if path.endswith("instance-action"):
                self._spot = {"raw": body}
            elif path.endswith("scheduled"):
                self._maintenance = [{"raw": body}]

    def clear(self) -> None:
        with self._lock:
            self._spot, self._maintenance, self._rebalance = None, [], None

    def expire_tokens(self) -> None:
        with self._lock:
            self._tokens.clear()

    def fail(self, kind: str, count: int = 1, *, status: int = 500,
             seconds: float = 5.0) -> None:
        """The next ``count`` requests: ``status`` (an HTTP error), ``hang`` (no answer for
        ``seconds``) or ``malformed`` (a body that is not what the path serves)."""
        if kind not in ("status", "hang", "malformed"):
            raise ValueError(f"unknown fault {kind!r}")
        with self._lock:
            self._faults.append(_Fault(kind, count, status, seconds))

    def request_count(self, path: Optional[str] = None) -> int:
        with self._lock:
            return sum(1 for _m, p, _s in self.requests if path is None or p == path)

    # ------------------------------------------------------------------ serving

    def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        server = ThreadingHTTPServer((host, port), _Handler)
        server.daemon_threads = True
        server.emulator = self  # type: ignore[attr-defined]
        self._server = server
        threading.Thread(target=server.serve_forever, name="aws-imds", daemon=True).start()
        return self.url

    @property
    def url(self) -> str:
        assert self._server is not None, "not started"
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def stop(self) -> None:
        self._stopping.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    def __enter__(self) -> AwsImdsEmulator:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def answer(self, method: str, path: str, headers: Any) -> tuple[int, str]:
        fault = self._take_fault()
        if fault is not None and fault.kind == "hang":
            self._stopping.wait(fault.seconds)
        if fault is not None and fault.kind == "status":
            return fault.status, "error"
        if method == "PUT" and path == TOKEN_PATH:
            return self._token(headers)
        if method != "GET" or path not in _PATHS:
            return 404, "Not Found"
        if not self._authorized(headers):
            return 401, ""
        if fault is not None and fault.kind == "malformed":
            return 200, "<html>not json"
        with self._lock:
            if path.endswith("instance-id"):
                return 200, self.instance_id
            if path.endswith("instance-action"):
                return self._json_or_404(self._spot)
            if path.endswith("scheduled"):
                if self._maintenance and "raw" in self._maintenance[0]:
                    return 200, self._maintenance[0]["raw"]
                return 200, json.dumps(self._maintenance)
            return self._json_or_404(self._rebalance)

    @staticmethod
    def _json_or_404(value: Optional[dict[str, str]]) -> tuple[int, str]:
        if value is None:
            return 404, "Not Found"
        if "raw" in value:
            return 200, value["raw"]
        return 200, json.dumps(value)

    def _token(self, headers: Any) -> tuple[int, str]:
        self.token_requests += 1
        ttl = headers.get("X-aws-ec2-metadata-token-ttl-seconds")
        if ttl is None or not ttl.isdigit() or not 1 <= int(ttl) <= 21600:
            return 400, "Bad Request"
        token = secrets.token_urlsafe(32)
        with self._lock:
            self._tokens[token] = self._clock() + int(ttl)
        return 200, token

    def _authorized(self, headers: Any) -> bool:
        token = headers.get("X-aws-ec2-metadata-token")
        if token is None:
            return self.imdsv1
        with self._lock:
            expiry = self._tokens.get(token)
        return expiry is not None and self._clock() < expiry

    def _take_fault(self) -> Optional[_Fault]:
        with self._lock:
            if not self._faults:
                return None
            fault = self._faults[0]
            fault.count -= 1
            if fault.count <= 0:
                self._faults.pop(0)
            return fault


class _Handler(BaseHTTPRequestHandler):
    server: Any
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        self._reply("GET")

    def do_PUT(self) -> None:
        self._reply("PUT")

    def _reply(self, method: str) -> None:
        emulator: AwsImdsEmulator = self.server.emulator
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        status, body = emulator.answer(method, self.path, self.headers)
        with emulator._lock:
            emulator.requests.append((method, self.path, status))
        data = body.encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        pass
