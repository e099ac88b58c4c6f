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

Control from Python (:meth:`interrupt`, :meth:`schedule_maintenance`,
:meth:`recommend_rebalance`, :meth:`clear`, :meth:`expire_tokens`, :meth:`fail`) or over
HTTP (``sidecar.tools.emulator.metadata``): ``POST /_emulator/interrupt {"in_seconds":
120, "action": "terminate"}``, ``/_emulator/maintenance {"in_seconds": 3600}``,
``/_emulator/rebalance {}``, ``/_emulator/expire-tokens {}``, ``/_emulator/clear``.
"""

from __future__ import annotations

import json
import secrets
import time
from datetime import datetime, timezone
from email.utils import format_datetime
from typing import Any, Callable, Optional

from sidecar.tools.emulator.metadata import ControlError, MetadataEmulator, Reply, number, text

__all__ = ["AwsImdsEmulator"]

TOKEN_PATH = "/latest/api/token"
_PATHS = {
    "/latest/meta-data/instance-id",
    "/latest/meta-data/spot/instance-action",
    "/latest/meta-data/events/maintenance/scheduled",
    "/latest/meta-data/events/recommendations/rebalance",
}


def _iso(unix: float) -> str:
    return datetime.fromtimestamp(unix, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _maintenance_date(unix: float) -> str:
    # EC2 writes "21 Jan 2019 09:00:43 GMT" (RFC 1123 without the weekday).
    return format_datetime(datetime.fromtimestamp(unix, timezone.utc), usegmt=True)[5:]


class AwsImdsEmulator(MetadataEmulator):
    service = "aws-imds"

    def __init__(
        self,
        instance_id: str = "i-0123456789abcdef0",
        *,
        imdsv1: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(clock=clock)
        self.instance_id = instance_id
        self.imdsv1 = imdsv1
        self._tokens: dict[str, float] = {}  # token -> expiry (clock)
        self._spot: Optional[dict[str, str]] = None
        self._maintenance: list[dict[str, str]] = []
        self._rebalance: Optional[dict[str, str]] = None
        self.token_requests = 0

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

    def control(self, verb: str, request: dict[str, Any]) -> None:
        now = time.time()
        if verb == "interrupt":
            self.interrupt(now + number(request, "in_seconds", 120),
                           text(request, "action", "terminate"))
        elif verb == "maintenance":
            self.schedule_maintenance(now + number(request, "in_seconds", 3600),
                                      text(request, "code", "system-reboot"))
        elif verb == "rebalance":
            self.recommend_rebalance(now)
        elif verb == "expire-tokens":
            self.expire_tokens()
        else:
            raise ControlError(f"no control verb {verb!r}; use interrupt, maintenance, "
                               "rebalance, expire-tokens, clear, fault")

    def describe(self) -> dict[str, Any]:
        with self._lock:
            return {"instance_id": self.instance_id, "spot": self._spot,
                    "maintenance": list(self._maintenance), "rebalance": self._rebalance}

    def answer(self, method: str, path: str, query: dict[str, str], headers: Any,
               body: bytes) -> Reply:
        return Reply(*self._answer(method, path, headers))

    def _answer(self, method: str, path: str, headers: Any) -> tuple[int, str]:
        if method == "PUT" and path == TOKEN_PATH:
            return self._token(headers)
        if method != "GET" or path not in _PATHS:
            return 404, "Not Found"
        if not self._authorized(headers):
            return 401, ""
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
