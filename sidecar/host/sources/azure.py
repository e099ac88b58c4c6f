"""Azure: Scheduled Events (Spot eviction, maintenance, deletion) from the Instance
Metadata Service (IMDS).

Every poll (once a second: Azure's own advice, as a Preempt comes only 30 s ahead,
https://learn.microsoft.com/azure/virtual-machines/linux/scheduled-events#polling-frequency):

- ``GET /metadata/scheduledevents?api-version=2020-07-01`` with ``Metadata: true`` gives
  ``{"DocumentIncarnation": 3, "Events": [{"EventId", "EventType", "ResourceType",
  "Resources", "EventStatus", "NotBefore", "Description", "EventSource",
  "DurationInSeconds"}]}``. ``NotBefore`` is RFC 1123 ("Mon, 19 Sep 2016 18:29:47 GMT")
  while the event is ``Scheduled`` and empty once it has ``Started``.
- Events are sent to every VM of an availability set or scale-set placement group, so
  only those whose ``Resources`` name this VM count. The name (and the vmId, served as
  the instance id) is read once from ``/metadata/instance/compute/...?format=text``.
- ``Preempt`` is a preemption deadline; ``Terminate``, ``Reboot`` and ``Redeploy`` are
  maintenance deadlines (the job loses its memory or its VM); ``Freeze`` pauses the VM
  for seconds and is listed as advisory only. An event already started is a deadline at
  the moment we first saw it started (or its last ``NotBefore``, if earlier): it does not
  slide from one poll to the next.

Approval (``--azure-approve true``): :meth:`AzureSource.pending` lists this VM's events
not yet started nor approved by us; the daemon approves one (:meth:`AzureSource.approve`,
``POST`` of ``{"StartRequests": [{"EventId": ...}]}``) once a checkpoint saved after the
event was first seen is durable, so Azure need not wait out the notice.

urllib3 does the HTTP with no proxy (IMDS must not be reached through one) and short
timeouts (0.5 s connect, 1 s read), except for the first Scheduled Events request: Azure
turns the service on for a VM at that request and may take up to two minutes to answer.
IMDS allows 5 requests a second per VM; a poll makes one once the name is known.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Callable, Optional
from urllib.parse import urlencode

from sidecar.host.sources.base import Observation, SourceError
from sidecar.host.sources.metadata_http import clip, probe_failure, request
from sidecar.host.sources.spec import Option, SourceSpec, SourceTraits, parse_boolean, parse_url
from sidecar.models import (
    DEFAULT_AZURE_METADATA_URL,
    KIND_MAINTENANCE,
    KIND_PREEMPTION,
    Notice,
    observation_from_notices,
)
from sidecar.timeparse import TimestampError, parse_http_date

__all__ = ["SPEC", "AzureConfig", "AzureSource", "build", "probe"]

log = logging.getLogger("sidecar.host.sources.azure")

POLL_INTERVAL_SECONDS = 1.0
SCHEDULED_EVENTS_PATH = "/metadata/scheduledevents"
SCHEDULED_EVENTS_API_VERSION = "2020-07-01"
NAME_PATH = "/metadata/instance/compute/name"
VM_ID_PATH = "/metadata/instance/compute/vmId"
INSTANCE_API_VERSION = "2021-02-01"
# Every IMDS request must carry it (and no X-Forwarded-For), or IMDS answers 400.
METADATA_HEADERS = {"Metadata": "true"}
# Scheduled Events is switched on by the first request, which may take two minutes.
FIRST_READ_TIMEOUT_SECONDS = 120.0

DEADLINE_KINDS = {
    "Preempt": KIND_PREEMPTION,
    "Terminate": KIND_MAINTENANCE,
    "Reboot": KIND_MAINTENANCE,
    "Redeploy": KIND_MAINTENANCE,
}
ADVISORY_TYPES = ("Freeze",)
STARTED = "Started"


@dataclass(frozen=True)
class _Event:
    """One event of the document, checked."""

    event_id: str
    event_type: str
    status: str
    not_before_unix: Optional[float]  # None: empty NotBefore (the event has started)
    resources: tuple[str, ...]


@dataclass
class _Seen:
    """What we remember about an event between polls."""

    first_seen: float
    not_before_unix: Optional[float] = None  # the last NotBefore it had
    started_at: Optional[float] = None  # when we first saw it started

    def deadline(self, event: _Event, now: float) -> float:
        if event.not_before_unix is not None:
            self.not_before_unix = event.not_before_unix
            if event.status != STARTED:
                return event.not_before_unix
        if self.started_at is None:
            self.started_at = now
        if self.not_before_unix is not None:
            return min(self.not_before_unix, self.started_at)
        return self.started_at


class AzureSource:
    name = "azure"
    #: The poller polls this source this often, whatever --poll-interval says.
    poll_interval_seconds = POLL_INTERVAL_SECONDS

    def __init__(
        self,
        url: str = DEFAULT_AZURE_METADATA_URL,
        *,
        approve_enabled: bool = False,
        connect_timeout: float = 0.5,
        read_timeout: float = 1.0,
        first_read_timeout: float = FIRST_READ_TIMEOUT_SECONDS,
        clock: Callable[[], float] = time.time,
    ) -> None:
        import urllib3  # lazily: the settings table imports every source module
        self._url = url.rstrip("/")
        #: The daemon approves events (StartRequests) only when this is set.
        self.approve_enabled = approve_enabled
        self._timeout = urllib3.Timeout(connect=connect_timeout, read=read_timeout)
        self._first_timeout = urllib3.Timeout(connect=connect_timeout, read=first_read_timeout)
        self._http = urllib3.PoolManager(retries=False, timeout=self._timeout)
        self._clock = clock
        self._answered = False  # Scheduled Events answered once: short timeouts from now
        self._vm_name: Optional[str] = None
        self._vm_id: Optional[str] = None
        # Shared with the thread that calls pending() / approve().
        self._lock = threading.Lock()
        self._seen: dict[str, _Seen] = {}
        self._approved: set[str] = set()
        self._pending: list[tuple[str, float, str]] = []

    # ------------------------------------------------------------------ poll

    def poll(self) -> Observation:
        document = self._scheduled_events()  # first: it may be slow the first time
        vm_name = self._own_name()
        events = [e for e in _parse_document(document) if _names(vm_name, e.resources)]
        now = self._clock()
        notices = []
        with self._lock:
            present = {event.event_id for event in events}
            self._seen = {k: v for k, v in self._seen.items() if k in present}
            self._approved &= present
            for event in events:
                notices.append(self._notice(event, now))
            self._pending = [
                (e.event_id, self._seen[e.event_id].first_seen, e.event_type)
                for e in events
                if e.status != STARTED and e.event_id not in self._approved
            ]
        return observation_from_notices(notices, instance_id=self._vm_id)

    def _notice(self, event: _Event, now: float) -> Notice:
        """Call with ``self._lock`` held."""
        seen = self._seen.get(event.event_id)
        if seen is None:
            seen = self._seen[event.event_id] = _Seen(first_seen=now)
            log.warning("Azure scheduled event %s %s (%s) for this VM", event.event_type,
                        event.event_id, event.status)
        deadline = seen.deadline(event, now)
        detail = clip(f"{event.event_type} {event.event_id}", 80)
        if event.event_type in ADVISORY_TYPES:
            return Notice(KIND_MAINTENANCE, deadline, advisory=True, detail=detail)
        # A type Azure adds later is taken as a deadline: something will happen to the VM.
        return Notice(DEADLINE_KINDS.get(event.event_type, KIND_MAINTENANCE), deadline,
                      detail=detail)

    def _own_name(self) -> str:
        """This VM's name, read once, and with it the vmId if IMDS gives it (asked once:
        IMDS allows 5 requests a second)."""
        if self._vm_name is not None:
            return self._vm_name
        status, body = self._get_text(NAME_PATH)
        if status != 200 or not body.strip():
            raise SourceError(f"IMDS compute name: HTTP {status} from {self._url}{NAME_PATH}: "
                              f"{_error_of(body)} (needed to tell this VM's events from its "
                              "neighbours')")
        self._vm_name = body.strip()
        try:
            status, vm_id = self._get_text(VM_ID_PATH)
        except SourceError:
            status, vm_id = 0, ""  # only the instance id is lost: not worth a failed poll
        self._vm_id = vm_id.strip() if status == 200 and vm_id.strip() else None
        return self._vm_name

    # ------------------------------------------------------------------ approval

    def pending(self) -> list[tuple[str, float, str]]:
        """(event id, first seen as Unix seconds, event type) of this VM's events that
        have not started and that we have not approved, as of the last poll."""
        with self._lock:
            return list(self._pending)

    def approve(self, event_ids: Iterable[str]) -> None:
        """Let these events start now (StartRequests). Raises SourceError on failure."""
        ids = list(dict.fromkeys(event_ids))
        if not ids:
            return
        if not self.approve_enabled:
            raise SourceError("Azure scheduled events are not approved unless "
                              "--azure-approve true")
        with self._lock:
            unknown = [event_id for event_id in ids if event_id not in self._seen]
        if unknown:
            raise SourceError(f"not an event of this VM: {clip(', '.join(unknown))}")
        body = json.dumps({"StartRequests": [{"EventId": event_id} for event_id in ids]})
        response = self._request("POST", SCHEDULED_EVENTS_PATH, _events_query(), self._timeout,
                                 body=body.encode(), content_type="application/json")
        if response.status != 200:
            text = response.data.decode("utf-8", "replace")
            raise SourceError(f"IMDS scheduled events approval: HTTP {response.status} from "
                              f"{self._url}: {_error_of(text)}",
                              throttled=response.status == 429)
        with self._lock:
            self._approved.update(ids)
            self._pending = [p for p in self._pending if p[0] not in self._approved]
        log.info("approved Azure scheduled event(s) %s", ", ".join(ids))

    # ------------------------------------------------------------------ HTTP

    def _scheduled_events(self) -> Any:
        timeout = self._timeout if self._answered else self._first_timeout
        response = self._request("GET", SCHEDULED_EVENTS_PATH, _events_query(), timeout)
        self._answered = True
        body = response.data.decode("utf-8", "replace")
        if response.status != 200:
            raise SourceError(f"IMDS scheduled events: HTTP {response.status} from "
                              f"{self._url}{SCHEDULED_EVENTS_PATH}: {_error_of(body)}",
                              throttled=response.status == 429)
        try:
            return json.loads(body)
        except ValueError:
            raise SourceError(f"IMDS scheduled events: not JSON: {clip(body)}") from None

    def _get_text(self, path: str) -> tuple[int, str]:
        query = {"api-version": INSTANCE_API_VERSION, "format": "text"}
        response = self._request("GET", path, query, self._timeout)
        return response.status, response.data.decode("utf-8", "replace")

    def _request(self, method: str, path: str, query: dict[str, str], timeout: Any, *,
                 body: Optional[bytes] = None, content_type: Optional[str] = None) -> Any:
        headers = dict(METADATA_HEADERS)
        if content_type is not None:
            headers["Content-Type"] = content_type
        return request(self._http, method, f"{self._url}{path}?{urlencode(query)}",
                       body=body, headers=headers, place=f"IMDS at {self._url}",
                       cloud="Azure", timeout=timeout)


def _events_query() -> dict[str, str]:
    return {"api-version": SCHEDULED_EVENTS_API_VERSION}


def _names(vm_name: str, resources: tuple[str, ...]) -> bool:
    # Azure resource names are case-insensitive.
    return vm_name.casefold() in (resource.casefold() for resource in resources)


def _parse_document(document: Any) -> list[_Event]:
    """Every event of the document, checked before any is used: a bad one fails the poll
    and the last good answer is kept."""
    if not isinstance(document, dict) or not isinstance(document.get("Events"), list):
        raise SourceError(f"IMDS scheduled events: no Events list in {clip(document)}")
    return [_parse_event(event) for event in document["Events"]]


def _parse_event(event: Any) -> _Event:
    if not isinstance(event, dict) or not isinstance(event.get("EventId"), str):
        raise SourceError(f"IMDS scheduled event without an EventId: {clip(event)}")
    event_id = clip(event["EventId"], 60)
    event_type = event.get("EventType")
    resources = event.get("Resources")
    if not isinstance(event_type, str) or not isinstance(resources, list) or not all(
        isinstance(resource, str) for resource in resources
    ):
        raise SourceError(f"IMDS scheduled event {event_id}: EventType or Resources "
                          f"missing: {clip(event)}")
    status = str(event.get("EventStatus", ""))
    text = event.get("NotBefore") or ""
    try:
        not_before = parse_http_date(text).unix if text else None
    except TimestampError as exc:
        raise SourceError(f"IMDS scheduled event {clip(event_type, 20)} {event_id}: "
                          f"NotBefore: {exc}") from None
    return _Event(event_id, event_type, status, not_before, tuple(resources))


def _error_of(body: str) -> str:
    """IMDS's own reason: the ``error`` of its JSON error body, else the body, clipped."""
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        error = None
    return clip(error if isinstance(error, str) else body.strip() or "(empty body)")


@dataclass(frozen=True)
class AzureConfig:
    azure_metadata_url: str
    azure_approve: bool


def probe(config: AzureConfig, timeout: float) -> Optional[str]:
    """None when an Azure metadata service answers at the configured address (for
    ``--source auto``), else why not, in one line."""
    import urllib3  # lazily: the settings table imports every source module
    url = config.azure_metadata_url.rstrip("/")
    query = urlencode({"api-version": INSTANCE_API_VERSION, "format": "text"})
    http = urllib3.PoolManager(retries=False, timeout=urllib3.Timeout(total=timeout))
    try:
        response = http.request("GET", f"{url}{NAME_PATH}?{query}", headers=METADATA_HEADERS,
                                redirect=False)
        if response.status == 200 and response.data.strip():
            return None
        return f"no Azure metadata service at {url} (compute name: HTTP {response.status})"
    except urllib3.exceptions.HTTPError as exc:
        return f"no Azure metadata service at {url} ({probe_failure(exc, timeout)})"
    finally:
        http.clear()


def build(config: AzureConfig) -> AzureSource:
    return AzureSource(config.azure_metadata_url, approve_enabled=config.azure_approve)


SPEC = SourceSpec(
    name="azure", config=AzureConfig, build=build, probe=probe,
    summary="Scheduled Events", aliases=("az",),
    notice_seconds=30.0,  # a Preempt event: at least 30 s
    traits=SourceTraits(poll_interval_seconds=POLL_INTERVAL_SECONDS),
    options=(
        Option("azure_metadata_url", parse_url, f"Azure Instance Metadata Service for the "
               f"azure source (default {DEFAULT_AZURE_METADATA_URL})", "URL"),
        Option("azure_approve", parse_boolean, "approve a pending Azure scheduled event "
               "(StartRequests) once a checkpoint saved after it was announced is durable, "
               "so the platform need not wait out the notice: true or false (default false)",
               "BOOL"),
    ),
)
