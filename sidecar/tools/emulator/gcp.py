"""A fake GCE metadata server speaking its wire format, for the gcp source.

    GET /computeMetadata/v1/instance/id                    5810234567890123456
    GET /computeMetadata/v1/instance/machine-type          projects/N/machineTypes/TYPE
    GET /computeMetadata/v1/instance/preempted             FALSE | TRUE
    GET /computeMetadata/v1/instance/maintenance-event     NONE | MIGRATE_ON_HOST_MAINTENANCE
                                                           | TERMINATE_ON_HOST_MAINTENANCE
    GET /computeMetadata/v1/instance/upcoming-maintenance  {} or a scheduled window (JSON)
    GET /computeMetadata/v1/instance/?recursive=true       the instance directory as JSON

As the real one: a request without ``Metadata-Flavor: Google`` is a 403, and so is one
carrying ``X-Forwarded-For`` (the server answers the VM itself, never through a proxy);
every answer carries ``Metadata-Flavor: Google`` and, on a 200, an ``ETag`` that changes
with the value (the base's injected faults stand for a broken gateway: no such header).
``?wait_for_change=true&last_etag=E&timeout_sec=N`` answers at once when the value's ETag
is not ``E``, else holds the request until the value changes or ``N`` seconds pass, then
answers the value as it is (without ``last_etag``: until it changes).

Control from Python (:meth:`preempt`, :meth:`maintenance`, :meth:`schedule_maintenance`,
:meth:`set_raw`, :meth:`clear`, :meth:`fail`) or over HTTP
(``sidecar.tools.emulator.metadata``): ``POST /_emulator/preempt``,
``/_emulator/maintenance {"event": "TERMINATE_ON_HOST_MAINTENANCE"}``,
``/_emulator/schedule-maintenance {"in_seconds": 86400}``, ``/_emulator/clear``.
"""

from __future__ import annotations

import hashlib
import json
import time
from datetime import datetime, timezone
from typing import Any, Callable, Optional

from sidecar.tools.emulator.metadata import ControlError, MetadataEmulator, Reply, number, text

__all__ = ["MAINTENANCE_EVENTS", "GcpMetadataEmulator"]

PREFIX = "/computeMetadata/v1/instance/"
MAINTENANCE_EVENTS = (
    "NONE",
    "MIGRATE_ON_HOST_MAINTENANCE",
    "TERMINATE_ON_HOST_MAINTENANCE",
)
DEFAULT_WAIT_SECONDS = 300  # a long poll without timeout_sec is still bounded here
_TEXT = "application/text"  # what GCE calls a plain value
_JSON = "application/json"


def etag_of(body: str) -> str:
    """An ETag the way GCE makes one: the same value always has the same tag."""
    return hashlib.sha256(body.encode()).hexdigest()[:16]


def _iso(unix: float) -> str:
    return datetime.fromtimestamp(unix, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


class GcpMetadataEmulator(MetadataEmulator):
    service = "gcp-metadata"

    def __init__(
        self,
        instance_id: str = "5810234567890123456",
        *,
        machine_type: str = "a3-highgpu-8g",
        project_number: str = "123456789012",
        cluster_name: Optional[str] = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(clock=clock)
        self.instance_id = instance_id
        self.machine_type = machine_type
        self.project_number = project_number
        #: ``attributes/cluster-name``: set on a GKE node; None serves a 404 (a plain VM).
        self.cluster_name = cluster_name
        #: The ``Metadata-Flavor`` every answer carries; None leaves it out (not GCE).
        self.flavor: Optional[str] = "Google"
        self._preempted = False
        self._maintenance_event = "NONE"
        self._upcoming: Optional[dict[str, str]] = None
        self._raw: dict[str, str] = {}  # key -> a body served verbatim (a broken value)
        self._waiting = 0

    # ------------------------------------------------------------------ control

    def preempt(self) -> None:
        """Compute Engine preempts the VM: ``preempted`` turns ``TRUE``."""
        with self._lock:
            self._preempted = True
            self.changed()

    def maintenance(self, event: str = "TERMINATE_ON_HOST_MAINTENANCE") -> None:
        if event not in MAINTENANCE_EVENTS:
            raise ControlError(f"event must be one of {', '.join(MAINTENANCE_EVENTS)}, "
                               f"got {event!r}")
        with self._lock:
            self._maintenance_event = event
            self.changed()

    def schedule_maintenance(self, start_unix: float, *, hours: float = 2.0,
                             status: str = "PENDING") -> None:
        """A maintenance window announced ahead (``upcoming-maintenance``), written as
        the metadata server's documentation shows it."""
        with self._lock:
            self._upcoming = {
                "can_reschedule": "true",
                "latest_window_start_time": _iso(start_unix),
                "maintenance_status": status,
                "type": "SCHEDULED",
                "window_end_time": _iso(start_unix + hours * 3600),
                "window_start_time": _iso(start_unix),
            }
            self.changed()

    def set_raw(self, key: str, body: str) -> None:
        """Serve ``body`` verbatim at ``instance/<key>`` (a value the source must refuse)."""
        with self._lock:
            self._raw[key] = body
            self.changed()

    def clear(self) -> None:
        with self._lock:
            self._preempted, self._maintenance_event, self._upcoming = False, "NONE", None
            self._raw.clear()
            self.changed()

    def waiting(self) -> int:
        """Long polls held right now, waiting for a change."""
        with self._lock:
            return self._waiting

    def control(self, verb: str, request: dict[str, Any]) -> None:
        if verb == "preempt":
            self.preempt()
        elif verb == "maintenance":
            self.maintenance(text(request, "event", "TERMINATE_ON_HOST_MAINTENANCE"))
        elif verb == "schedule-maintenance":
            self.schedule_maintenance(time.time() + number(request, "in_seconds", 86400),
                                      status=text(request, "status", "PENDING"))
        else:
            raise ControlError(f"no control verb {verb!r}; use preempt, maintenance, "
                               "schedule-maintenance, clear, fault")

    def describe(self) -> dict[str, Any]:
        with self._lock:
            return {"instance_id": self.instance_id, "machine_type": self.machine_type,
                    "preempted": self._preempted, "maintenance_event": self._maintenance_event,
                    "upcoming_maintenance": self._upcoming, "waiting": self._waiting}

    # ------------------------------------------------------------------ serving

    def answer(self, method: str, path: str, query: dict[str, str], headers: Any,
               body: bytes) -> Reply:
        reply = self._answer(method, path, query, headers)
        if self.flavor is not None:
            reply.headers["Metadata-Flavor"] = self.flavor  # on every answer, as GCE does
        return reply

    def _answer(self, method: str, path: str, query: dict[str, str], headers: Any) -> Reply:
        if headers.get("X-Forwarded-For") is not None:
            return Reply(403, "Request had X-Forwarded-For header and was refused: the "
                         "metadata server answers the VM itself only.\n")
        if headers.get("Metadata-Flavor") != "Google":
            return Reply(403, "Missing Metadata-Flavor:Google header.\n")
        if method != "GET":
            return Reply(405, "Method not allowed.\n")
        if query.get("wait_for_change") not in (None, "true", "false"):
            return Reply(400, "wait_for_change must be true or false.\n")
        timeout = query.get("timeout_sec", str(DEFAULT_WAIT_SECONDS))
        if not timeout.isdigit() or int(timeout) < 1:
            return Reply(400, "timeout_sec must be a positive integer.\n")
        with self._lock:
            value = self._render(path, query)
            if value is None:
                return Reply(404, "Not Found.\n")
            if query.get("wait_for_change") == "true":
                value = self._wait(path, query, value, int(timeout))
        body_text, content_type = value
        return Reply(200, body_text, {"ETag": etag_of(body_text)}, content_type)

    def _wait(self, path: str, query: dict[str, str], value: tuple[str, str],
              timeout: int) -> tuple[str, str]:
        """Hold the request (``self._lock`` held) while the value keeps ``last_etag``."""
        baseline = query.get("last_etag") or etag_of(value[0])

        def unchanged() -> bool:
            now = self._render(path, query)
            return now is not None and etag_of(now[0]) == baseline

        if not unchanged():
            return value
        self._waiting += 1
        try:
            self.wait_for_change(timeout, unchanged)
        finally:
            self._waiting -= 1
        return self._render(path, query) or value

    def _render(self, path: str, query: dict[str, str]) -> Optional[tuple[str, str]]:
        """(body, content type) at ``path`` now, or None for a 404. ``self._lock`` held."""
        if not path.startswith(PREFIX):
            return None
        key = path[len(PREFIX):]
        if key in self._raw:
            return self._raw[key], _TEXT
        if key == "":
            if query.get("recursive") == "true":
                return json.dumps(self._directory()), _JSON
            return "id\nmachine-type\nmaintenance-event\npreempted\nupcoming-maintenance\n", _TEXT
        if key == "upcoming-maintenance":
            return json.dumps(self._upcoming or {}), _JSON
        values = {
            "id": self.instance_id,
            "machine-type": self._machine_type_path(),
            "preempted": "TRUE" if self._preempted else "FALSE",
            "maintenance-event": self._maintenance_event,
        }
        if self.cluster_name is not None:
            values["attributes/cluster-name"] = self.cluster_name
        return (values[key], _TEXT) if key in values else None

    def _machine_type_path(self) -> str:
        return f"projects/{self.project_number}/machineTypes/{self.machine_type}"

    def _directory(self) -> dict[str, Any]:
        # The real server spells the keys in camelCase here, and the id as a number.
        return {
            "id": int(self.instance_id) if self.instance_id.isdigit() else self.instance_id,
            "machineType": self._machine_type_path(),
            "maintenanceEvent": self._maintenance_event,
            "preempted": "TRUE" if self._preempted else "FALSE",
            "upcomingMaintenance": self._upcoming or {},
        }
