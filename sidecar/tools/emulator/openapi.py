"""The ECS OpenAPI bodies the emulator answers with, in the service's wire format.

Pure functions from request parameters and a view of the emulated instance to JSON-ready
dicts; the HTTP plumbing lives in ``server.py``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Optional

__all__ = [
    "ACTIONS",
    "API_VERSION",
    "SERVICE",
    "Instance",
    "error_body",
    "ids_from",
    "new_request_id",
    "result_body",
    "system_event",
]

API_VERSION = "2020-04-01"
SERVICE = "ecs"
ACTIONS = ("DescribeInstances", "DescribeScheduledInstances", "DescribeSystemEvents")
SYSTEM_EVENTS_PAGE = 20  # the service's default page size, when MaxResults is not given
# Fixed, plausible values: the daemon reads none of them, but a wire format test
# should see the shape of a real answer.
_CREATED_AT = "2026-11-01T10:00:00+08:00"
_INSTANCE_TYPE = "ecs.hpcpni3ln.45xlarge"


@dataclass(frozen=True)
class Instance:
    """The one emulated ESI instance, as one request sees it (faults applied)."""

    instance_id: str
    scheduled_instance_id: Optional[str]
    region: str
    # None: the field is left out (no scheduled release); "" is served as "".
    auto_release_at: Optional[str]
    # System events in the wire format (``Id``, ``ResourceId``, ``Type``, ``Status``, ...).
    system_events: tuple[dict[str, Any], ...] = ()

    @property
    def zone_id(self) -> str:
        return f"{self.region}-a"


def new_request_id() -> str:
    """Like the service's: a timestamp followed by random hex."""
    return time.strftime("%Y%m%d%H%M%S", time.gmtime()) + os.urandom(10).hex().upper()


def _metadata(action: str, region: str, request_id: str) -> dict[str, Any]:
    return {
        "RequestId": request_id,
        "Action": action,
        "Version": API_VERSION,
        "Service": SERVICE,
        "Region": region,
    }


def error_body(
    action: str, region: str, code: str, message: str, request_id: str
) -> dict[str, Any]:
    """An error answer: the error sits inside ResponseMetadata and there is no Result."""
    metadata = _metadata(action, region, request_id)
    metadata["Error"] = {"Code": code, "Message": message}
    return {"ResponseMetadata": metadata}


def ids_from(params: Sequence[tuple[str, str]], name: str) -> list[str]:
    """``Name.1=a&Name.2=b`` (the SDK's list encoding) -> ``["a", "b"]`` in index order."""
    indexed: list[tuple[int, str]] = []
    for key, value in params:
        prefix, dot, index = key.partition(".")
        if prefix == name and dot and index.isdigit():
            indexed.append((int(index), value))
    return [value for _, value in sorted(indexed)]


def _instance_json(instance: Instance) -> dict[str, Any]:
    body: dict[str, Any] = {
        "InstanceId": instance.instance_id,
        "InstanceName": f"esi-sidecar-emulated-{instance.instance_id}",
        "Status": "RUNNING",
        "ZoneId": instance.zone_id,
        "InstanceTypeId": _INSTANCE_TYPE,
        "InstanceChargeType": "PostPaid",
        "CreatedAt": _CREATED_AT,
        "ScheduledInstanceId": instance.scheduled_instance_id or "",
    }
    if not instance.scheduled_instance_id:
        # A plain instance: the real service leaves the field out or empty.
        del body["ScheduledInstanceId"]
    return body


def _scheduled_json(instance: Instance) -> dict[str, Any]:
    body: dict[str, Any] = {
        "ScheduledInstanceId": instance.scheduled_instance_id,
        "ScheduledInstanceName": f"esi-sidecar-emulated-{instance.scheduled_instance_id}",
        "Status": "Active",
        "ZoneId": instance.zone_id,
        "Count": 1,
        "DeliveryCount": 1,
        "ReleaseCount": 0,
        "CreatedAt": _CREATED_AT,
        "UpdatedAt": _CREATED_AT,
    }
    if instance.auto_release_at is not None:
        body["AutoReleaseAt"] = instance.auto_release_at
    return body


def _describe_instances(params: Sequence[tuple[str, str]], instance: Instance) -> dict[str, Any]:
    wanted = ids_from(params, "InstanceIds")
    found = [instance] if not wanted or instance.instance_id in wanted else []
    return {
        "Instances": [_instance_json(item) for item in found],
        "TotalCount": len(found),
        "NextToken": "",
    }


def _describe_scheduled(params: Sequence[tuple[str, str]], instance: Instance) -> dict[str, Any]:
    wanted = ids_from(params, "ScheduledInstanceIds")
    known = instance.scheduled_instance_id
    found = [instance] if known and (not wanted or known in wanted) else []
    return {"ScheduledInstanceInfo": [_scheduled_json(item) for item in found], "NextToken": ""}


def system_event(event_id: str, resource_id: str, event_type: str, status: str,
                 created_at: str, operated_start_at: str = "") -> dict[str, Any]:
    """One event of ``DescribeSystemEvents``, with every field the service writes."""
    return {
        "Id": event_id,
        "ResourceId": resource_id,
        "Type": event_type,
        "Status": status,
        "Category": "ResourceEvent",
        "ImpactLevel": "Critical",
        "CreatedAt": created_at,
        "UpdatedAt": created_at,
        "OperatedStartAt": operated_start_at,
        "OperatedEndAt": "",
        "ExtraInfo": {},
    }


def _describe_system_events(params: Sequence[tuple[str, str]],
                            instance: Instance) -> dict[str, Any]:
    """Filters as the service applies them (each list filter: any of its values); the
    page token is the index of the next event, an opaque string to the caller."""
    filters = {field: ids_from(params, name) for field, name in (
        ("ResourceId", "ResourceIds"), ("Id", "EventIds"), ("Type", "Types"),
        ("Status", "Status"))}
    values = dict(params)
    events = [event for event in instance.system_events
              if all(not wanted or event.get(field) in wanted
                     for field, wanted in filters.items())]
    start = values.get("CreatedAtStart")
    if start:
        events = [event for event in events if _unix(event["CreatedAt"]) >= _unix(start)]
    offset = int(values.get("NextToken") or 0)
    size = int(values.get("MaxResults") or SYSTEM_EVENTS_PAGE)
    page = events[offset:offset + size]
    more = offset + size < len(events)
    return {"SystemEvents": page, "NextToken": str(offset + size) if more else ""}


def _unix(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def result_body(
    action: str, params: Sequence[tuple[str, str]], instance: Instance, request_id: str
) -> dict[str, Any]:
    """A successful answer to one of :data:`ACTIONS`. Unknown ids give empty lists,
    as the service does, rather than an error."""
    if action == "DescribeInstances":
        result = _describe_instances(params, instance)
    elif action == "DescribeScheduledInstances":
        result = _describe_scheduled(params, instance)
    elif action == "DescribeSystemEvents":
        result = _describe_system_events(params, instance)
    else:
        raise ValueError(f"unsupported action {action!r}")
    return {"ResponseMetadata": _metadata(action, instance.region, request_id), "Result": result}
