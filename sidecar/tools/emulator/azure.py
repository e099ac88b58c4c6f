"""A fake Azure Instance Metadata Service (IMDS) speaking its wire format, for the azure
source.

    GET  /metadata/scheduledevents?api-version=2020-07-01     the Scheduled Events document
    POST /metadata/scheduledevents?api-version=2020-07-01     {"StartRequests": [{"EventId"}]}
    GET  /metadata/instance?api-version=2021-02-01            {"compute": {...}, "network": ...}
    GET  /metadata/instance/compute/name?api-version=...&format=text      this VM's name
    GET  /metadata/versions                                    (no api-version needed)

As the real one (https://learn.microsoft.com/azure/virtual-machines/instance-metadata-service):
a request without ``Metadata: true`` is a 400 ``{"error": "Bad request. Required metadata
header not specified"}``; one with ``X-Forwarded-For`` is refused too (the docs say only
"rejected": the status and wording here are ours); ``api-version`` is required and must be
one IMDS knows; a leaf such as ``compute/name`` needs ``format=text``.

Scheduled Events as Azure documents them
(https://learn.microsoft.com/azure/virtual-machines/linux/scheduled-events):
``DocumentIncarnation`` grows with every change; ``NotBefore`` reads "Mon, 19 Sep 2016
18:29:47 GMT"; an event moves to ``Started`` (``NotBefore`` empty) once approved or once
its ``NotBefore`` passes, and leaves the document when it is over (:meth:`complete`) or
is cancelled (:meth:`clear`). An approval is recorded in :attr:`approved`.

Control from Python (:meth:`schedule`, :meth:`start_event`, :meth:`complete`, :meth:`clear`,
:meth:`fail`, :meth:`refuse_approvals`) or over HTTP (``sidecar.tools.emulator.metadata``): ``POST
/_emulator/event {"type": "Preempt", "in_seconds": 30}`` (also ``resources``, ``status``,
``not_before``), ``/_emulator/start {"id": ...}``, ``/_emulator/complete {"id": ...}``,
``/_emulator/clear``.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from email.utils import format_datetime
from typing import Any, Callable, Optional

from sidecar.tools.emulator.metadata import ControlError, MetadataEmulator, Reply, number, text

__all__ = ["EVENT_TYPES", "AzureImdsEmulator", "http_date"]

EVENT_TYPES = ("Freeze", "Reboot", "Redeploy", "Preempt", "Terminate")
SCHEDULED_EVENTS_PATH = "/metadata/scheduledevents"
INSTANCE_PATH = "/metadata/instance"
VERSIONS_PATH = "/metadata/versions"
# The versions the docs list (newest first); Scheduled Events has its own.
INSTANCE_VERSIONS = (
    "2025-04-07", "2024-07-17", "2024-03-15", "2023-11-15", "2023-07-01", "2021-12-13",
    "2021-11-15", "2021-11-01", "2021-10-01", "2021-08-01", "2021-05-01", "2021-03-01",
    "2021-02-01", "2021-01-01", "2020-12-01", "2020-10-01", "2020-09-01", "2020-07-15",
    "2020-06-01", "2019-11-01", "2019-08-15", "2019-08-01", "2019-06-04", "2019-06-01",
    "2019-04-30", "2019-03-11", "2019-02-01", "2018-10-01", "2018-04-02", "2018-02-01",
    "2017-12-01", "2017-10-01", "2017-08-01", "2017-04-02", "2017-03-01",
)
SCHEDULED_EVENTS_VERSIONS = ("2020-07-01", "2019-08-01", "2019-04-01", "2019-01-01",
                             "2017-11-01", "2017-08-01", "2017-03-01")
HEADER_ERROR = "Bad request. Required metadata header not specified"
FORWARDED_ERROR = "Bad request. Requests with an X-Forwarded-For header are not accepted"
VERSION_ERROR = ("Bad request. api-version is invalid or was not specified in the request. "
                 "For more information refer to aka.ms/azureimds")
# Descriptions Azure writes (from the docs' examples), by event type.
DESCRIPTIONS = {
    "Freeze": "Virtual machine is being paused because of a memory-preserving Live "
              "Migration operation.",
    "Reboot": "Host server is undergoing maintenance.",
    "Redeploy": "Host server is undergoing maintenance.",
}
JSON_TYPE = "application/json; charset=utf-8"


def http_date(unix: float) -> str:
    """How Scheduled Events writes ``NotBefore``: "Mon, 19 Sep 2016 18:29:47 GMT"."""
    return format_datetime(datetime.fromtimestamp(unix, timezone.utc), usegmt=True)


@dataclass
class _Event:
    event_id: str
    event_type: str
    resources: list[str]
    not_before_unix: Optional[float]  # None: NotBefore was given verbatim
    not_before_text: str
    status: str = "Scheduled"
    source: str = "Platform"

    def wire(self) -> dict[str, Any]:
        return {
            "EventId": self.event_id,
            "EventStatus": self.status,
            "EventType": self.event_type,
            "ResourceType": "VirtualMachine",
            "Resources": list(self.resources),
            "NotBefore": "" if self.status == "Started" else self.not_before_text,
            "Description": DESCRIPTIONS.get(self.event_type, ""),
            "EventSource": self.source,
            "DurationInSeconds": 5 if self.event_type == "Freeze" else -1,
        }


def _json(status: int, body: Any) -> Reply:
    return Reply(status, json.dumps(body), content_type=JSON_TYPE)


def _error(status: int, message: str, **extra: Any) -> Reply:
    return _json(status, {"error": message, **extra})


class AzureImdsEmulator(MetadataEmulator):
    service = "azure-imds"

    def __init__(
        self,
        vm_name: str = "sidecar-vm-0",
        vm_id: str = "5c08b38e-4d57-4c23-ac45-aca61037f084",
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(clock=clock)
        self.vm_name = vm_name
        self.vm_id = vm_id
        self._incarnation = 1
        self._events: dict[str, _Event] = {}
        self.approved: list[str] = []  # event ids approved through StartRequests
        self._refusals = 0  # approvals still to answer with a 500 (refuse_approvals)

    # ------------------------------------------------------------------ control

    def refuse_approvals(self, count: int = 1) -> None:
        """Answer the next ``count`` approvals (``POST`` StartRequests) with a 500, as the
        service does when it fails; the polls of the document are not touched."""
        with self._lock:
            self._refusals += count

    def schedule(self, event_type: str, in_seconds: float,
                 resources: Optional[list[str]] = None, *, status: str = "Scheduled",
                 not_before: Optional[str] = None, source: str = "Platform") -> str:
        """A new event ``in_seconds`` from now (whole seconds, as Azure writes them) for
        ``resources`` (default: this VM); ``not_before`` is served verbatim instead.
        Returns its EventId."""
        if event_type not in EVENT_TYPES:
            raise ControlError(f"type must be one of {', '.join(EVENT_TYPES)}, "
                               f"got {event_type!r}")
        if status not in ("Scheduled", "Started"):
            raise ControlError(f"status must be Scheduled or Started, got {status!r}")
        when = float(round(time.time() + in_seconds))
        event = _Event(str(uuid.uuid4()).upper(), event_type,
                       list(resources) if resources is not None else [self.vm_name],
                       None if not_before is not None else when,
                       http_date(when) if not_before is None else not_before, status, source)
        with self._lock:
            self._events[event.event_id] = event
            self._bump()
        return event.event_id

    def start_event(self, event_id: str) -> None:
        """The event begins: ``Started``, ``NotBefore`` empty. (``start()`` is the
        base's: it starts serving.)"""
        with self._lock:
            self._started(self._event(event_id))

    def complete(self, event_id: str) -> None:
        """The event is over: it leaves the document."""
        with self._lock:
            self._event(event_id)
            del self._events[event_id]
            self._bump()

    def clear(self) -> None:
        with self._lock:
            if self._events:
                self._events.clear()
                self._bump()

    def control(self, verb: str, request: dict[str, Any]) -> None:
        if verb == "event":
            unknown = set(request) - {"type", "in_seconds", "resources", "status", "not_before"}
            if unknown:
                raise ControlError(f"unknown field(s) {sorted(unknown)}; use type, "
                                   "in_seconds, resources, status, not_before")
            resources = request.get("resources")
            if resources is not None and not (
                isinstance(resources, list) and all(isinstance(r, str) for r in resources)
            ):
                raise ControlError(f"resources must be a list of VM names, got {resources!r}")
            not_before = request.get("not_before")
            self.schedule(text(request, "type"), number(request, "in_seconds", 900),
                          resources, status=text(request, "status", "Scheduled"),
                          not_before=None if not_before is None else str(not_before))
        elif verb == "start":
            self.start_event(text(request, "id"))
        elif verb == "complete":
            self.complete(text(request, "id"))
        else:
            raise ControlError(f"no control verb {verb!r}; use event, start, complete, "
                               "clear, fault")

    def describe(self) -> dict[str, Any]:
        with self._lock:
            return {"vm_name": self.vm_name, "vm_id": self.vm_id,
                    "document": self._document(), "approved": list(self.approved)}

    # ------------------------------------------------------------------ state (lock held)

    def _event(self, event_id: str) -> _Event:
        event = self._events.get(event_id)
        if event is None:
            raise ControlError(f"no event {event_id!r}")
        return event

    def _bump(self) -> None:
        self._incarnation += 1
        self.changed()

    def _started(self, event: _Event) -> None:
        if event.status != "Started":
            event.status = "Started"
            self._bump()

    def _document(self) -> dict[str, Any]:
        # Azure starts an event by itself once its NotBefore has passed.
        now = time.time()
        for event in self._events.values():
            if event.not_before_unix is not None and event.not_before_unix <= now:
                self._started(event)
        return {"DocumentIncarnation": self._incarnation,
                "Events": [event.wire() for event in self._events.values()]}

    # ------------------------------------------------------------------ serving

    def answer(self, method: str, path: str, query: dict[str, str], headers: Any,
               body: bytes) -> Reply:
        if headers.get("X-Forwarded-For") is not None:
            return _error(400, FORWARDED_ERROR)
        if str(headers.get("Metadata", "")).lower() != "true":
            return _error(400, HEADER_ERROR)
        path = path.rstrip("/")
        if path == VERSIONS_PATH:
            return _json(200, {"apiVersions": sorted(INSTANCE_VERSIONS)})
        if path == SCHEDULED_EVENTS_PATH:
            return self._scheduled_events(method, query, body)
        if path == INSTANCE_PATH or path.startswith(INSTANCE_PATH + "/"):
            return self._instance(method, path, query)
        return _error(404, "Not found")

    def _scheduled_events(self, method: str, query: dict[str, str], body: bytes) -> Reply:
        if query.get("api-version") not in SCHEDULED_EVENTS_VERSIONS:
            return _error(400, VERSION_ERROR, **{"newest-versions":
                                                 list(SCHEDULED_EVENTS_VERSIONS[:3])})
        if method == "GET":
            with self._lock:
                return _json(200, self._document())
        if method == "POST":
            return self._approve(body)
        return _error(405, "Method not allowed")

    def _approve(self, body: bytes) -> Reply:
        with self._lock:
            if self._refusals:
                self._refusals -= 1
                return _error(500, "Internal server error")
        try:
            requests = json.loads(body.decode("utf-8"))["StartRequests"]
            event_ids = [str(request["EventId"]) for request in requests]
        except (UnicodeDecodeError, ValueError, KeyError, TypeError):
            return _error(400, "Bad request. The request body is not a valid StartRequests "
                               "document")
        with self._lock:
            unknown = [event_id for event_id in event_ids if event_id not in self._events]
            if unknown or not event_ids:
                return _error(400, f"Bad request. Invalid EventId(s): {', '.join(unknown)}")
            for event_id in event_ids:
                # One VM here, so the approval is enough: the event starts at once.
                self._started(self._events[event_id])
                self.approved.append(event_id)
        return Reply(200, "", content_type=JSON_TYPE)

    def _instance(self, method: str, path: str, query: dict[str, str]) -> Reply:
        if query.get("api-version") not in INSTANCE_VERSIONS:
            return _error(400, VERSION_ERROR, **{"newest-versions": list(INSTANCE_VERSIONS[:3])})
        if method != "GET":
            return _error(405, "Method not allowed")
        node: Any = self._instance_document()
        for key in path[len(INSTANCE_PATH):].strip("/").split("/"):
            if not key:
                continue
            if not isinstance(node, dict) or key not in node:
                return _error(404, "Not found")
            node = node[key]
        if isinstance(node, dict):
            return _json(200, node)
        if query.get("format") != "text":
            return _error(400, "Bad request. Query parameter format=text is required for "
                               "a leaf node")
        return Reply(200, str(node), content_type="text/plain; charset=utf-8")

    def _instance_document(self) -> dict[str, Any]:
        return {
            "compute": {"name": self.vm_name, "vmId": self.vm_id, "location": "westeurope",
                        "priority": "Spot", "evictionPolicy": "Delete",
                        "vmSize": "Standard_ND96asr_v4", "osType": "Linux"},
            "network": {"interface": []},
        }
