"""A fake Volcengine cloud on one real HTTP server: the ECS OpenAPI, the ECS metadata
service and a small control API for tests and the demo.

    /?Action=DescribeInstances&Version=2020-04-01&InstanceIds.1=...   signed OpenAPI
    /?Action=DescribeScheduledInstances&...&ScheduledInstanceIds.1=...
    /?Action=DescribeSystemEvents&...&ResourceIds.1=...                 system events
    /latest/instance_id, /latest/region_id                              metadata (text)
    /latest/spot_instance_termination_time          404, or the reclaim time (text)
    /_emulator/state | release | fault | event | spot                   control (JSON)

Standard library only. ``Emulator.start()`` serves on a daemon thread and returns;
``stop()`` shuts the server down and wakes any request held by a ``slow`` fault.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from collections.abc import Mapping
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, NamedTuple, Optional
from urllib.parse import parse_qsl, urlsplit

from sidecar.tools.emulator.openapi import (
    ACTIONS,
    API_VERSION,
    SERVICE,
    Instance,
    error_body,
    new_request_id,
    result_body,
    system_event,
)
from sidecar.tools.emulator.signing import AuthError, Credentials, verify
from sidecar.tools.emulator.state import FAULT_KINDS, AccountLimit, EmulatorState, release_in

__all__ = ["DEFAULT_ACCESS_KEY", "DEFAULT_SECRET_KEY", "Emulator"]

logger = logging.getLogger("sidecar.tools.emulator")

DEFAULT_ACCESS_KEY = "AKLTemulator00000000"
DEFAULT_SECRET_KEY = "emulator-secret-key"
_MAX_BODY = 1 << 20
SPOT_PATH = "/latest/spot_instance_termination_time"

_SIGNATURE_MISMATCH = (
    "The request signature we calculated does not match the signature you provided. "
    "Check your Secret Access Key and signing method. Consult the service documentation "
    "for details."
)
# fault kind -> (HTTP status, error code, message), as the service words them.
_ERROR_FAULTS: dict[str, tuple[int, str, str]] = {
    "throttle": (429, "Throttling.User", "Request was denied due to user flow control."),
    "flow-limit": (429, "FlowLimitExceeded", "Flow limit exceeded, please try again later."),
    "server-error": (
        500,
        "InternalError",
        "Service has some internal Error. Pls Contact With Admin.",
    ),
    "auth": (401, "SignatureDoesNotMatch", _SIGNATURE_MISMATCH),
    # A policy that does not allow the action (IAM), and an endpoint that does not offer
    # it: definite refusals, which asking again does not change (issue 22, item 7).
    "forbidden": (403, "AccessDenied", "User is not authorized to perform: {action}"),
    "invalid-action": (400, "InvalidAction", "The action {action} is not valid for this "
                       "endpoint."),
}


class _Reply(NamedTuple):
    status: int
    body: bytes
    content_type: str = "application/json"
    byte_seconds: float = 0.0  # > 0: sent a byte at a time, this long apart (a trickle)


def _json_reply(status: int, body: Any) -> _Reply:
    return _Reply(status, json.dumps(body).encode("utf-8"))


def _text_reply(status: int, text: str) -> _Reply:
    return _Reply(status, text.encode("utf-8"), "text/plain; charset=utf-8")


def _control_error(status: int, message: str) -> _Reply:
    return _json_reply(status, {"error": message})


class Emulator:
    """One emulated ESI instance in one region, behind a signed ECS OpenAPI."""

    def __init__(
        self,
        *,
        access_key: str = DEFAULT_ACCESS_KEY,
        secret_key: str = DEFAULT_SECRET_KEY,
        region: str = "cn-beijing",
        instance_id: str = "i-emu0001",
        scheduled_instance_id: Optional[str] = "esi-emu0001",
        auto_release_at: Optional[str] = None,
        session_token: Optional[str] = None,
    ) -> None:
        self.region = region
        self.instance_id = instance_id
        # None: the instance is a plain (non-ESI) instance.
        self.scheduled_instance_id = scheduled_instance_id
        self._credentials = Credentials(access_key, secret_key, session_token or None)
        self._state = EmulatorState(auto_release_at)
        # The account's rate (set_account_limit): None, no limit.
        self.account_limit: Optional[AccountLimit] = None
        self._stopping = threading.Event()
        self._server: Optional[_Server] = None
        self._thread: Optional[threading.Thread] = None

    # -- lifecycle -------------------------------------------------------------------

    def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Bind and serve on a daemon thread; return the base URL."""
        if self._server is not None:
            raise RuntimeError("emulator already started")
        self._stopping.clear()
        server = _Server((host, port), self)
        self._server = server
        # A short poll interval keeps stop() quick (shutdown waits for one interval).
        self._thread = threading.Thread(
            target=server.serve_forever, args=(0.05,), name="esi-emulator", daemon=True
        )
        self._thread.start()
        logger.info("emulator serving on %s", self.url)
        return self.url

    def stop(self) -> None:
        """Stop serving and release the port. Safe to call twice."""
        server, thread = self._server, self._thread
        if server is None:
            return
        self._stopping.set()
        server.shutdown()
        server.server_close()
        if thread is not None:
            thread.join()
        self._server = self._thread = None

    @property
    def url(self) -> str:
        if self._server is None:
            raise RuntimeError("emulator not started")
        host, port = self._server.server_address[:2]
        shown = host.decode() if isinstance(host, bytes) else host
        return f"http://{shown}:{port}"

    def __enter__(self) -> Emulator:
        if self._server is None:
            self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # -- control from Python ---------------------------------------------------------

    def set_release(self, auto_release_at: Optional[str]) -> None:
        """Serve this raw string as AutoReleaseAt ("" allowed); None leaves it out."""
        self._state.set_release(auto_release_at)

    def set_release_in(self, seconds: float) -> str:
        """Release ``seconds`` from now, written like the API (``+08:00``); returns it."""
        value = release_in(seconds)
        self._state.set_release(value)
        return value

    def inject_fault(self, kind: str, count: Optional[int] = None, delay: float = 0.0,
                     action: Optional[str] = None) -> None:
        """Show fault ``kind`` for the next ``count`` requests it applies to (None: until
        cleared), of OpenAPI action ``action`` only when given. ``delay`` is the pause of a
        ``slow`` fault.

        Any OpenAPI request: ``throttle`` (429 Throttling.User), ``flow-limit`` (429
        FlowLimitExceeded), ``server-error`` (500 InternalError), ``auth`` (401
        SignatureDoesNotMatch), ``forbidden`` (403 AccessDenied), ``invalid-action`` (400
        InvalidAction), ``malformed-json`` (200, body cut in half), ``slow``.
        DescribeScheduledInstances: ``bad-release`` ("not-a-time"), ``empty-release`` ("").
        DescribeInstances: ``non-esi`` (no ScheduledInstanceId). Metadata paths:
        ``metadata-down`` (500). The spot path only: ``spot-down`` (500),
        ``spot-garbage`` (200, an HTML page), ``spot-slow`` (no answer for ``delay`` s),
        ``spot-trickle`` (a byte every ``delay`` s). Unknown kinds raise ValueError.
        """
        self._state.add_fault(kind, count, delay, action)

    def clear_faults(self) -> None:
        self._state.clear_faults()

    def set_account_limit(self, per_second: Optional[float],
                          burst: Optional[float] = None) -> Optional[AccountLimit]:
        """Throttle signed OpenAPI calls beyond ``per_second`` (bursts of ``burst``) as the
        service does when an account's flow control trips: 429 ``Throttling.User``. None
        lifts it. Every host pointed at this emulator shares it, as hosts share an
        account. Returns the limit (its ``allowed``/``throttled`` counters)."""
        self.account_limit = None if per_second is None else AccountLimit(per_second, burst)
        return self.account_limit

    def raise_event(self, event_type: str = "SpotInstanceInterruption_Delete", *,
                    in_seconds: Optional[float] = None, status: str = "Scheduled",
                    resource_id: Optional[str] = None, created_ago: float = 0.0) -> str:
        """A system event for this instance (or ``resource_id``); ``in_seconds``: when the
        platform acts (``OperatedStartAt``), None leaves the field empty, as the service
        does for a spot interruption. Returns the event id."""
        event_id = "e-" + os.urandom(8).hex()
        operated = "" if in_seconds is None else release_in(in_seconds)
        self._state.add_event(system_event(
            event_id, resource_id or self.instance_id, event_type, status,
            created_at=release_in(-created_ago), operated_start_at=operated))
        return event_id

    def raise_spot_notice(self, in_seconds: float = 300.0, *,
                          text: Optional[str] = None) -> str:
        """Serve a spot reclaim at /latest/spot_instance_termination_time: ``in_seconds``
        from now in UTC, as the ECS guide shows it (``2026-12-01T10:00:00Z``), or ``text``
        verbatim (another format, or garbage). Returns what is served."""
        if text is None:
            text = datetime.fromtimestamp(math.floor(time.time() + in_seconds),
                                          timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        self._state.set_spot_termination_time(text)
        return text

    def clear_spot_notice(self) -> None:
        """The spot path answers 404 again."""
        self._state.set_spot_termination_time(None)

    def set_event_status(self, event_id: str, status: str) -> None:
        self._state.update_event(event_id, Status=status)

    def clear_events(self) -> None:
        self._state.clear_events()

    def request_count(self, action: Optional[str] = None) -> int:
        """OpenAPI requests received (all actions, or one), signed correctly or not."""
        return self._state.request_count(action)

    def metadata_request_count(self) -> int:
        return self._state.metadata_request_count()

    def snapshot(self) -> dict[str, Any]:
        """What ``GET /_emulator/state`` answers."""
        body = {
            "region": self.region,
            "instance_id": self.instance_id,
            "scheduled_instance_id": self.scheduled_instance_id,
            "fault_kinds": list(FAULT_KINDS),
        }
        body.update(self._state.snapshot())
        return body

    # -- answers (called by the HTTP handler) ----------------------------------------

    def answer_api(
        self, method: str, raw_query: str, headers: Mapping[str, str], body: bytes
    ) -> _Reply:
        params = parse_qsl(raw_query, keep_blank_values=True)
        form: list[tuple[str, str]] = []
        content_type = next((v for k, v in headers.items() if k.lower() == "content-type"), "")
        if method == "POST" and content_type.startswith("application/x-www-form-urlencoded"):
            # Form POSTs carry their parameters in the body; only the URL query is signed
            # as the query, the body through its hash.
            form = parse_qsl(body.decode("utf-8", "replace"), keep_blank_values=True)
        values = dict(params + form)
        action, version = values.get("Action", ""), values.get("Version", "")
        self._state.count_api(action or "(none)")
        request_id = new_request_id()

        def error(status: int, code: str, message: str) -> _Reply:
            return _json_reply(status, error_body(action, self.region, code, message, request_id))

        for name, value in (("Action", action), ("Version", version)):
            if not value:
                return error(400, "MissingParameter", f"The request is missing {name} parameter.")
        try:
            verify(
                method=method,
                path="/",
                query=params,
                headers=headers,
                body=body,
                credentials=self._credentials,
                region=self.region,
                service=SERVICE,
            )
        except AuthError as exc:
            return error(exc.status, exc.code, exc.message)
        if action not in ACTIONS or version != API_VERSION:
            message = f"Could not find operation {action} for version {version}."
            return error(404, "InvalidActionOrVersion", message)

        limit = self.account_limit
        if limit is not None and not limit.allow():
            status, code, message = _ERROR_FAULTS["throttle"]
            return error(status, code, message)
        faults = {fault.kind: fault for fault in self._state.take_faults(action)}
        if "slow" in faults:
            self._stopping.wait(faults["slow"].delay)
        for kind, (status, code, message) in _ERROR_FAULTS.items():
            if kind in faults:
                return error(status, code, message.format(action=f"ecs:{action}"))

        release = self._state.auto_release_at
        if "bad-release" in faults:
            release = "not-a-time"
        elif "empty-release" in faults:
            release = ""
        instance = Instance(
            instance_id=self.instance_id,
            scheduled_instance_id=None if "non-esi" in faults else self.scheduled_instance_id,
            region=self.region,
            auto_release_at=release,
            system_events=tuple(self._state.events),
        )
        reply = _json_reply(200, result_body(action, params + form, instance, request_id))
        if "malformed-json" in faults:
            # Cut mid-document, as a proxy or a crashed backend might.
            return reply._replace(body=reply.body[: len(reply.body) // 2])
        return reply

    def answer_metadata(self, method: str, path: str) -> _Reply:
        self._state.count_metadata()
        if method != "GET":
            return _text_reply(405, "method not allowed\n")
        if any(f.kind == "metadata-down" for f in self._state.take_faults("metadata")):
            return _text_reply(500, "Internal Server Error\n")
        if path == SPOT_PATH:
            return self._answer_spot()
        values = {"/latest/instance_id": self.instance_id, "/latest/region_id": self.region}
        if path not in values:
            return _text_reply(404, "Not Found\n")
        return _text_reply(200, values[path])

    def _answer_spot(self) -> _Reply:
        faults = {fault.kind: fault for fault in self._state.take_faults("spot")}
        if "spot-slow" in faults:
            self._stopping.wait(faults["spot-slow"].delay)
        if "spot-down" in faults:
            return _text_reply(500, "Internal Server Error\n")
        if "spot-garbage" in faults:
            return _Reply(200, b"<html><body>Service Unavailable</body></html", "text/html")
        text = self._state.spot_termination_time
        reply = _text_reply(404, "Not Found\n") if text is None else _text_reply(200, text)
        if "spot-trickle" in faults:
            reply = reply._replace(byte_seconds=faults["spot-trickle"].delay or 0.5)
        return reply

    def answer_control(self, method: str, path: str, body: bytes) -> _Reply:
        route = path.rstrip("/")
        if route == "/_emulator/state":
            if method != "GET":
                return _control_error(405, "use GET /_emulator/state")
            return _json_reply(200, self.snapshot())
        if route == "/_emulator/fault" and method == "DELETE":
            self.clear_faults()
            return _json_reply(200, self.snapshot())
        if route == "/_emulator/event" and method == "DELETE":
            self.clear_events()
            return _json_reply(200, self.snapshot())
        if route == "/_emulator/spot" and method == "DELETE":
            self.clear_spot_notice()
            return _json_reply(200, self.snapshot())
        if route not in ("/_emulator/release", "/_emulator/fault", "/_emulator/event",
                         "/_emulator/spot"):
            return _control_error(404, f"no control endpoint {path!r}")
        if method != "POST":
            return _control_error(405, f"use POST {route}")
        try:
            request = json.loads(body.decode("utf-8") or "null")
        except (UnicodeDecodeError, ValueError) as exc:
            return _control_error(400, f"body is not JSON: {exc}")
        if not isinstance(request, dict):
            return _control_error(400, "body must be a JSON object")
        try:
            if route == "/_emulator/release":
                self._control_release(request)
            elif route == "/_emulator/event":
                self._control_event(request)
            elif route == "/_emulator/spot":
                self._control_spot(request)
            else:
                self._control_fault(request)
        except ValueError as exc:
            return _control_error(400, str(exc))
        return _json_reply(200, self.snapshot())

    def _control_release(self, request: Mapping[str, Any]) -> None:
        keys = set(request) & {"auto_release_at", "in_seconds"}
        if len(keys) != 1 or set(request) - keys:
            raise ValueError('give exactly one of {"auto_release_at": "..."} or {"in_seconds": 60}')
        if "in_seconds" in request:
            seconds = request["in_seconds"]
            if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
                raise ValueError(f"in_seconds must be a number, got {seconds!r}")
            if not math.isfinite(seconds):
                raise ValueError(f"in_seconds must be finite, got {seconds!r}")
            self.set_release_in(seconds)
        else:
            self.set_release(request["auto_release_at"])

    def _control_event(self, request: Mapping[str, Any]) -> None:
        unknown = set(request) - {"type", "in_seconds", "status", "resource_id"}
        if unknown:
            raise ValueError(f"unknown field(s) {sorted(unknown)}; use type, in_seconds, "
                             "status, resource_id")
        seconds = request.get("in_seconds")
        if seconds is not None and (isinstance(seconds, bool) or not isinstance(
                seconds, (int, float)) or not math.isfinite(seconds)):
            raise ValueError(f"in_seconds must be a finite number or null, got {seconds!r}")
        for key in ("type", "status", "resource_id"):
            if request.get(key) is not None and not isinstance(request[key], str):
                raise ValueError(f"{key} must be a string, got {request[key]!r}")
        self.raise_event(request.get("type") or "SpotInstanceInterruption_Delete",
                         in_seconds=seconds, status=request.get("status") or "Scheduled",
                         resource_id=request.get("resource_id"))

    def _control_spot(self, request: Mapping[str, Any]) -> None:
        unknown = set(request) - {"in_seconds", "termination_time"}
        if unknown or len(request) > 1:
            raise ValueError('give {"in_seconds": 300}, {"termination_time": "..."} or {}')
        if "termination_time" in request:
            if not isinstance(request["termination_time"], str):
                raise ValueError("termination_time must be a string")
            self.raise_spot_notice(text=request["termination_time"])
            return
        seconds = request.get("in_seconds", 300.0)
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not (
                math.isfinite(seconds)):
            raise ValueError(f"in_seconds must be a finite number, got {seconds!r}")
        self.raise_spot_notice(seconds)

    def _control_fault(self, request: Mapping[str, Any]) -> None:
        unknown = set(request) - {"kind", "count", "delay", "action"}
        if unknown:
            raise ValueError(f"unknown field(s) {sorted(unknown)}; use kind, count, delay, "
                             "action")
        kind = request.get("kind")
        if not isinstance(kind, str):
            raise ValueError(f"kind must be one of {', '.join(FAULT_KINDS)}")
        self.inject_fault(kind, request.get("count"), request.get("delay", 0.0),
                          request.get("action"))


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], emulator: Emulator) -> None:
        self.emulator = emulator
        super().__init__(address, _Handler)


class _Handler(BaseHTTPRequestHandler):
    server_version = "esi-sidecar-emulator"
    sys_version = ""
    server: _Server

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    def _read_body(self) -> Optional[bytes]:
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            return None
        if length < 0 or length > _MAX_BODY:
            return None
        return self.rfile.read(length) if length else b""

    def _dispatch(self, method: str) -> None:
        emulator = self.server.emulator
        url = urlsplit(self.path)
        body = self._read_body()
        if body is None:
            reply = _text_reply(400, "bad Content-Length\n")
        elif url.path.startswith("/_emulator/"):
            reply = emulator.answer_control(method, url.path, body)
        elif url.path.startswith("/latest/"):
            reply = emulator.answer_metadata(method, url.path)
        elif url.path == "/":
            reply = emulator.answer_api(method, url.query, dict(self.headers.items()), body)
        else:
            reply = _text_reply(404, "Not Found\n")
        try:
            self.send_response(reply.status)
            self.send_header("Content-Type", reply.content_type)
            self.send_header("Content-Length", str(len(reply.body)))
            self.end_headers()
            if reply.byte_seconds > 0:
                self._trickle(reply.body, reply.byte_seconds)
            else:
                self.wfile.write(reply.body)
        except (BrokenPipeError, ConnectionResetError):
            # The client stopped waiting (a read timeout during a slow fault).
            logger.debug("client went away before the answer to %s %s", method, url.path)

    def _trickle(self, body: bytes, byte_seconds: float) -> None:
        stopping = self.server.emulator._stopping
        for index in range(len(body)):
            self.wfile.write(body[index:index + 1])
            self.wfile.flush()
            if stopping.wait(byte_seconds):
                return

    def log_message(self, format: str, *args: Any) -> None:
        # Request lines only; never headers (they carry the Authorization signature).
        logger.debug("%s " + format, self.address_string(), *args)
