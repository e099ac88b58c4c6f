"""Volcengine ECS system events: a spot instance's interruption, platform maintenance and
repairs that stop, reboot or redeploy this instance, an ESI released by its event.

One poll is one ``DescribeSystemEvents`` call (ECS OpenAPI 2020-04-01, the SDK's
``ECSApi.describe_system_events``) for this instance (``ResourceIds.1``), created in the
last three days (the service's default window is one day, too short for maintenance
announced days ahead), every page. Status and type are filtered here rather than in the
request, so a type the service adds, or one a region does not know, cannot fail the call.

Types that announce the end of this instance (names as the API writes them; the console
writes ``SpotInstanceInterruption.Delete``, both are accepted), from the ECS API reference
(DescribeSystemEvents, DescribeEventTypes) and the SDKs' models:

- ``SpotInstanceInterruption_Delete``: the spot instance is reclaimed. The event comes
  five minutes before the reclaim (the ECS spot guide); when ``OperatedStartAt`` is empty
  the deadline is five minutes after the event's ``CreatedAt``.
- ``*_Redeploy``, ``*_Stop``, ``*_Reboot``, ``*_StopAndRepair``: maintenance or a failure
  the platform acts on at ``OperatedStartAt`` (a deadline for the job);
- ``ElasticScheduledInstance_AutoRelease``, ``AccountUnbalanced_Delete``: the instance
  is released;
- ``SystemFailure_PleaseCheck``, ``*_Repair``: advice, shown but never a deadline.

Events that have ended (``Succeeded``, ``Failed``, ``Rejected``, ``Canceled``,
``Recovered``) count for nothing. Without ``OperatedStartAt`` or ``CreatedAt`` a deadline
is five minutes after the event was first seen, fixed from then on.

The cadence is the daemon's ``--poll-interval`` (30 s by default: a five-minute spot notice
is learned with at least 4.4 minutes left, at 120 calls per host-hour); credentials,
endpoint, timeouts and error handling are the ``volcengine-esi`` source's.
"""

from __future__ import annotations

import logging
import time
from datetime import datetime, tzinfo
from functools import partial
from typing import Any, Callable, Optional

from sidecar.host.sources.base import Observation, SourceError
from sidecar.host.sources.spec import SourceSpec, SourceTraits
from sidecar.host.sources.volcengine import VolcengineConfig, VolcengineEsiSource, build_options
from sidecar.host.sources.volcengine import probe as probe_metadata
from sidecar.models import (
    KIND_MAINTENANCE,
    KIND_PREEMPTION,
    KIND_SCHEDULED_RELEASE,
    Notice,
    observation_from_notices,
)
from sidecar.timeparse import VOLCENGINE_TIMEZONE, TimestampError, parse_timestamp

__all__ = ["SPEC", "VolcengineEventsSource", "build", "event_notice", "probe"]

log = logging.getLogger("sidecar.host.sources.volcengine_events")

ACTION = "DescribeSystemEvents"
LOOKBACK_SECONDS = 3 * 86400
PAGE_SIZE = 100
MAX_PAGES = 5
SPOT_NOTICE_SECONDS = 300.0  # the spot interruption event comes 5 min before the reclaim
ENDED = frozenset({"Succeeded", "Failed", "Rejected", "Canceled", "Cancelled", "Recovered"})

# Exact types first; then the suffix after the last "_" decides.
_TYPE_KINDS = {
    "SpotInstanceInterruption_Delete": KIND_PREEMPTION,
    "ElasticScheduledInstance_AutoRelease": KIND_SCHEDULED_RELEASE,
    "AccountUnbalanced_Delete": KIND_PREEMPTION,
    "AccountUnbalanced_Stop": KIND_MAINTENANCE,
}
_ACTION_KINDS = {
    "Redeploy": KIND_MAINTENANCE,
    "Stop": KIND_MAINTENANCE,
    "Reboot": KIND_MAINTENANCE,
    "StopAndRepair": KIND_MAINTENANCE,
    "Delete": KIND_PREEMPTION,
}
_ADVICE = ("PleaseCheck", "Repair")


class VolcengineEventsSource(VolcengineEsiSource):
    """Polls ``DescribeSystemEvents`` for this instance."""

    name = "volcengine-events"

    def __init__(self, *, clock: Callable[[], float] = time.time, **options: Any) -> None:
        super().__init__(**options)
        self._clock = clock
        self._first_seen: dict[str, float] = {}  # event id -> when this source first saw it

    def _poll(self) -> Observation:
        if self._region is None:
            self._region = self._metadata("region_id")
            log.info("region %s (from the metadata service)", self._region)
        if self._instance_id is None:
            self._instance_id = self._metadata("instance_id")
            log.info("instance id %s (from the metadata service)", self._instance_id)
        now = self._clock()
        notices = []
        seen = set()
        assumed: set[str] = set()  # zones read into times without an offset
        for event in self._events(self._instance_id, now):
            event_id = str(_field(event, "id") or "")
            seen.add(event_id)
            first_seen = self._first_seen.setdefault(event_id, now)
            notice = event_notice(event, first_seen, self._naive_timezone, assumed=assumed)
            if notice is not None:
                notices.append(notice)
        self._first_seen = {k: v for k, v in self._first_seen.items() if k in seen}
        return observation_from_notices(notices, instance_id=self._instance_id,
                                        assumed_timezone=", ".join(sorted(assumed)) or None)

    def _events(self, instance_id: str, now: float) -> list[Any]:
        import volcenginesdkecs

        start = datetime.fromtimestamp(now - LOOKBACK_SECONDS, VOLCENGINE_TIMEZONE)
        start_text = start.isoformat("T", "seconds")
        events: list[Any] = []
        token = ""
        for _ in range(MAX_PAGES):
            request = volcenginesdkecs.DescribeSystemEventsRequest(
                resource_ids=[instance_id], created_at_start=start_text,
                max_results=str(PAGE_SIZE), next_token=token or None,
            )
            response = self._call(ACTION, partial(_describe, request=request))
            page = getattr(response, "system_events", None) or []
            if not isinstance(page, list):
                raise SourceError(f"{ACTION}: SystemEvents is not a list")
            events.extend(e for e in page if _field(e, "resource_id") in (None, instance_id))
            token = getattr(response, "next_token", None) or ""
            if not token:
                return events
        log.warning("%s: more than %d pages of events; reading the first %d", ACTION,
                    MAX_PAGES, MAX_PAGES * PAGE_SIZE)
        return events


def _describe(api: Any, request: Any) -> Any:
    return api.describe_system_events(request)


def event_notice(event: Any, first_seen: float,
                 naive_timezone: tzinfo = VOLCENGINE_TIMEZONE, *,
                 assumed: Optional[set[str]] = None) -> Optional[Notice]:
    """The notice one system event gives, None for an event that does not concern the
    instance's end (or has ended); SourceError for a time that is not a time. A time
    without an offset is read in ``naive_timezone`` (the service's own, UTC+8) and the
    zone added to ``assumed``."""
    event_type = str(_field(event, "type") or "").replace(".", "_")
    status = str(_field(event, "status") or "")
    if not event_type or status in ENDED:
        return None
    action = event_type.rpartition("_")[2]
    kind = _TYPE_KINDS.get(event_type) or _ACTION_KINDS.get(action)
    detail = f"{event_type} ({status or 'no status'}, event {_field(event, 'id')})"
    if kind is None:
        if action in _ADVICE:
            return Notice(KIND_MAINTENANCE, None, advisory=True, detail=detail)
        return None
    when = _time(event, "operated_start_at", naive_timezone, assumed)
    if when is None:
        created = _time(event, "created_at", naive_timezone, assumed)
        # No time to act given: the spot rule (five minutes after the event), counted
        # from the event's creation when known, else from when we first saw it.
        when = (created if created is not None else first_seen) + SPOT_NOTICE_SECONDS
    return Notice(kind, when, detail=detail)


def _time(event: Any, name: str, naive_timezone: tzinfo,
          assumed: Optional[set[str]]) -> Optional[float]:
    value = _field(event, name)
    if value is None or not str(value).strip():
        return None
    try:
        parsed = parse_timestamp(str(value), naive_timezone=naive_timezone)
        if parsed.assumed_timezone and assumed is not None:
            assumed.add(parsed.assumed_timezone)
        return parsed.unix
    except TimestampError as exc:
        wire = "".join(part.title() for part in name.split("_"))
        raise SourceError(f"{ACTION}: event {_field(event, 'id')} {wire}: {exc}") from None


def _field(event: Any, name: str) -> Any:
    """An SDK model's attribute, or a plain dict's wire key."""
    if isinstance(event, dict):
        return event.get("".join(part.title() for part in name.split("_")))
    return getattr(event, name, None)


def probe(config: VolcengineConfig, timeout: float) -> Optional[str]:
    """The ECS metadata service answers: the same test as the volcengine-esi source's."""
    return probe_metadata(config, timeout)


def build(config: VolcengineConfig) -> VolcengineEventsSource:
    return VolcengineEventsSource(**build_options(config))


# Its settings are the volcengine-esi source's rows; the cadence is --poll-interval.
SPEC = SourceSpec(
    name="volcengine-events", config=VolcengineConfig, build=build, probe=probe,
    summary="ECS system events: spot and early reclaim, maintenance",
    # Under --source auto an account whose policy allows the ESI calls but not this one
    # (or an endpoint without the action) skips it rather than degrading the daemon.
    notice_seconds=SPOT_NOTICE_SECONDS,  # the shortest of its events: a spot reclaim
    traits=SourceTraits(api_budget=True, optional=True),
)
