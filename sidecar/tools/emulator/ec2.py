"""A fake EC2 for the aws-capacity-block source: the instance metadata service (IMDSv2,
from :class:`AwsImdsEmulator`, plus the instance's region) and the EC2 Query API, on one
server, in their wire formats.

    PUT  /latest/api/token, GET /latest/meta-data/instance-id       IMDSv2 (as aws.py)
    GET  /latest/meta-data/placement/region                          "us-east-2"
    POST /  Action=DescribeInstances&Version=2016-11-15&InstanceId.1=i-...
    POST /  Action=DescribeCapacityReservations&Version=2016-11-15&CapacityReservationId.1=cr-...

The API is form-encoded, signed with SigV4 (checked: :mod:`sidecar.tools.emulator.sigv4`)
and answers EC2's XML (``DescribeInstancesResponse/reservationSet/item/instancesSet/item/
capacityReservationId``; ``DescribeCapacityReservationsResponse/capacityReservationSet/
item/endDate, reservationType, state``); errors are EC2's ``Response/Errors/Error/
Code, Message`` with a ``RequestID``.

Control from Python (:meth:`set_block_end`, :meth:`extend_block`, :meth:`set_reservation`,
:meth:`api_fail`) or over HTTP: ``POST /_emulator/capacity-block {"ends_in_seconds":
86400, "type": "capacity-block"}`` (``"type": null``: no reservation),
``/_emulator/extend {"seconds": 3600}``, ``/_emulator/api-fault {"kind": "throttle",
"count": 3}`` (kinds: ``throttle``, ``status``, ``garbage``, ``hang``).
"""

from __future__ import annotations

import secrets
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Optional
from urllib.parse import parse_qsl
from xml.sax.saxutils import escape

from sidecar.tools.emulator.aws import AwsImdsEmulator
from sidecar.tools.emulator.metadata import MALFORMED_BODY, ControlError, Reply, number
from sidecar.tools.emulator.sigv4 import AwsCredentials, SigV4Error, verify

__all__ = ["API_FAULTS", "API_VERSION", "DEFAULT_AWS_ACCESS_KEY", "DEFAULT_AWS_SECRET_KEY",
           "Ec2Emulator"]

API_VERSION = "2016-11-15"
DEFAULT_AWS_ACCESS_KEY = "AKIAEMULATOR00000001"
DEFAULT_AWS_SECRET_KEY = "emulator/secret/key/not+a+real+one000000"
API_FAULTS = ("throttle", "status", "garbage", "hang")
REGION_PATH = "/latest/meta-data/placement/region"
_NAMESPACE = f"http://ec2.amazonaws.com/doc/{API_VERSION}/"
_OWNER = "123456789012"


def _ec2_time(unix: float) -> str:
    # EC2 writes "2026-12-01T08:00:00.000Z".
    moment = datetime.fromtimestamp(unix, timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


@dataclass
class _Reservation:
    id: str
    type: str  # "capacity-block" or "default" (an On-Demand Capacity Reservation)
    start_unix: float
    end_unix: float
    state: str = "active"


@dataclass
class _ApiFault:
    kind: str
    count: int
    seconds: float = 5.0


def _xml(status: int, body: str) -> Reply:
    return Reply(status, '<?xml version="1.0" encoding="UTF-8"?>\n' + body,
                 content_type="text/xml;charset=UTF-8")


def _error(status: int, code: str, message: str) -> Reply:
    return _xml(status, f"<Response><Errors><Error><Code>{escape(code)}</Code><Message>"
                        f"{escape(message)}</Message></Error></Errors><RequestID>"
                        f"{_request_id()}</RequestID></Response>")


def _request_id() -> str:
    raw = secrets.token_hex(16)
    return f"{raw[:8]}-{raw[8:12]}-{raw[12:16]}-{raw[16:20]}-{raw[20:]}"


class Ec2Emulator(AwsImdsEmulator):
    service = "aws-ec2"

    def __init__(self, instance_id: str = "i-0123456789abcdef0", *, region: str = "us-east-2",
                 access_key: str = DEFAULT_AWS_ACCESS_KEY,
                 secret_key: str = DEFAULT_AWS_SECRET_KEY,
                 reservation_id: str = "cr-0a1b2c3d4e5f60718") -> None:
        super().__init__(instance_id)
        self.region = region
        self.credentials = AwsCredentials(access_key, secret_key)
        self._reservation_id = reservation_id
        now = time.time()
        self._reservation: Optional[_Reservation] = _Reservation(
            reservation_id, "capacity-block", now - 3600, now + 86400)
        self._api_faults: list[_ApiFault] = []
        self._api_calls: dict[str, int] = {}
        self._api_lock = threading.Lock()

    # ------------------------------------------------------------------ control

    def set_block_end(self, end_unix: float) -> None:
        """The Capacity Block (the instance's reservation) ends at ``end_unix``."""
        with self._lock:
            if self._reservation is None or self._reservation.type != "capacity-block":
                self._reservation = _Reservation(self._reservation_id, "capacity-block",
                                                 time.time() - 3600, end_unix)
            self._reservation.end_unix = end_unix

    def extend_block(self, seconds: float) -> float:
        """A Capacity Block extension: the end moves ``seconds`` later; the new end."""
        with self._lock:
            if self._reservation is None:
                raise ControlError("the instance has no capacity reservation to extend")
            self._reservation.end_unix += seconds
            return self._reservation.end_unix

    def set_reservation(self, reservation_type: Optional[str],
                        end_unix: Optional[float] = None) -> None:
        """The instance's reservation: ``capacity-block``, ``default`` (an On-Demand
        Capacity Reservation) or None (the instance runs outside any reservation)."""
        with self._lock:
            if reservation_type is None:
                self._reservation = None
                return
            end = end_unix if end_unix is not None else time.time() + 86400
            self._reservation = _Reservation(self._reservation_id, reservation_type,
                                             time.time() - 3600, end)

    def api_fail(self, kind: str, count: int = 1, *, seconds: float = 5.0) -> None:
        """The next ``count`` API requests: ``throttle`` (503 RequestLimitExceeded),
        ``status`` (500 InternalError), ``garbage`` (a 200 HTML page) or ``hang`` (no
        answer for ``seconds``)."""
        if kind not in API_FAULTS:
            raise ValueError(f"unknown API fault {kind!r}; choose from {', '.join(API_FAULTS)}")
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"count must be an integer >= 1, got {count!r}")
        with self._api_lock:
            self._api_faults.append(_ApiFault(kind, count, float(seconds)))

    def clear_faults(self) -> None:
        super().clear_faults()
        with self._api_lock:
            self._api_faults.clear()

    def api_calls(self, action: Optional[str] = None) -> int:
        """API requests answered (faults and refusals included), of ``action`` or all."""
        with self._api_lock:
            return sum(n for a, n in self._api_calls.items() if action in (None, a))

    def control(self, verb: str, request: dict[str, Any]) -> None:
        if verb == "capacity-block":
            kind = request.get("type", "capacity-block")
            if kind is not None and not isinstance(kind, str):
                raise ControlError(f"type must be a string or null, got {kind!r}")
            self.set_reservation(kind, time.time() + number(request, "ends_in_seconds", 86400))
        elif verb == "extend":
            self.extend_block(number(request, "seconds", 3600))
        elif verb == "api-fault":
            self.api_fail(str(request.get("kind")), request.get("count", 1),
                          seconds=number(request, "seconds", 5.0))
        else:
            super().control(verb, request)

    def describe(self) -> dict[str, Any]:
        state = super().describe()
        with self._lock:
            block = self._reservation
            state["region"] = self.region
            state["reservation"] = None if block is None else {
                "id": block.id, "type": block.type, "state": block.state,
                "end": _ec2_time(block.end_unix)}
        with self._api_lock:
            state["api_calls"] = dict(self._api_calls)
        return state

    # ------------------------------------------------------------------ serving

    def answer(self, method: str, path: str, query: dict[str, str], headers: Any,
               body: bytes) -> Reply:
        if method == "GET" and path == REGION_PATH:
            if not self._authorized(headers):
                return Reply(401, "")
            return Reply(200, self.region)
        if method == "POST" and path == "/":
            return self._api(headers, body)
        return super().answer(method, path, query, headers, body)

    def _api(self, headers: Any, body: bytes) -> Reply:
        params = dict(parse_qsl(body.decode("utf-8", "replace"), keep_blank_values=True))
        action = params.get("Action", "")
        with self._api_lock:
            self._api_calls[action] = self._api_calls.get(action, 0) + 1
        fault = self._take_api_fault()
        if fault is not None and fault.kind == "hang":
            self._stopping.wait(fault.seconds)
        try:
            verify(self.credentials, method="POST", path="/", query=[], headers=headers,
                   body=body, region=self.region, service="ec2")
        except SigV4Error as exc:
            return _error(exc.status, exc.code, exc.message)
        if fault is not None and fault.kind == "throttle":
            return _error(503, "RequestLimitExceeded", "Request limit exceeded.")
        if fault is not None and fault.kind == "status":
            return _error(500, "InternalError", "An internal error has occurred")
        if fault is not None and fault.kind == "garbage":
            return Reply(200, MALFORMED_BODY, content_type="text/html")
        if params.get("Version") != API_VERSION:
            return _error(400, "InvalidParameterValue", f"Version {params.get('Version')!r}")
        if action == "DescribeInstances":
            return self._describe_instances(params)
        if action == "DescribeCapacityReservations":
            return self._describe_reservations(params)
        return _error(400, "InvalidAction", f"The action {action} is not valid for this "
                                            "web service.")

    def _take_api_fault(self) -> Optional[_ApiFault]:
        with self._api_lock:
            if not self._api_faults:
                return None
            fault = self._api_faults[0]
            fault.count -= 1
            if fault.count <= 0:
                self._api_faults.pop(0)
            return fault

    def _describe_instances(self, params: dict[str, str]) -> Reply:
        wanted = [v for k, v in params.items() if k.startswith("InstanceId.")]
        unknown = [i for i in wanted if i != self.instance_id]
        if unknown:
            return _error(400, "InvalidInstanceID.NotFound",
                          f"The instance ID '{unknown[0]}' does not exist")
        with self._lock:
            block = self._reservation
        zone = self.region + "a"
        reservation = ""
        lifecycle = ""
        if block is not None:
            reservation = (
                f"<capacityReservationId>{block.id}</capacityReservationId>"
                "<capacityReservationSpecification><capacityReservationPreference>"
                "capacity-reservations-only</capacityReservationPreference>"
                f"<capacityReservationTarget><capacityReservationId>{block.id}"
                "</capacityReservationId></capacityReservationTarget>"
                "</capacityReservationSpecification>")
            if block.type == "capacity-block":
                lifecycle = "<instanceLifecycle>capacity-block</instanceLifecycle>"
        return _xml(200, (
            f'<DescribeInstancesResponse xmlns="{_NAMESPACE}">'
            f"<requestId>{_request_id()}</requestId><reservationSet><item>"
            f"<reservationId>r-0f1e2d3c4b5a69788</reservationId><ownerId>{_OWNER}</ownerId>"
            "<groupSet/><instancesSet><item>"
            f"<instanceId>{escape(self.instance_id)}</instanceId>"
            "<imageId>ami-0abcdef1234567890</imageId>"
            "<instanceState><code>16</code><name>running</name></instanceState>"
            "<instanceType>p5.48xlarge</instanceType>"
            f"<placement><availabilityZone>{zone}</availabilityZone><groupName/>"
            "<tenancy>default</tenancy></placement>"
            f"{lifecycle}{reservation}"
            "</item></instancesSet></item></reservationSet></DescribeInstancesResponse>"))

    def _describe_reservations(self, params: dict[str, str]) -> Reply:
        wanted = [v for k, v in params.items() if k.startswith("CapacityReservationId.")]
        with self._lock:
            block = self._reservation
            items = "" if block is None else self._reservation_item(block)
            known = () if block is None else (block.id,)
        unknown = [w for w in wanted if w not in known]
        if unknown:
            return _error(400, "InvalidCapacityReservationId.NotFound",
                          f"The capacity reservation ID '{unknown[0]}' does not exist")
        return _xml(200, (
            f'<DescribeCapacityReservationsResponse xmlns="{_NAMESPACE}">'
            f"<requestId>{_request_id()}</requestId>"
            f"<capacityReservationSet>{items}</capacityReservationSet>"
            "</DescribeCapacityReservationsResponse>"))

    def _reservation_item(self, block: _Reservation) -> str:
        zone = self.region + "a"
        return (
            f"<item><capacityReservationId>{block.id}</capacityReservationId>"
            f"<ownerId>{_OWNER}</ownerId><capacityReservationArn>arn:aws:ec2:{self.region}:"
            f"{_OWNER}:capacity-reservation/{block.id}</capacityReservationArn>"
            f"<availabilityZone>{zone}</availabilityZone>"
            "<instanceType>p5.48xlarge</instanceType><instancePlatform>Linux/UNIX"
            "</instancePlatform><tenancy>default</tenancy><totalInstanceCount>1"
            "</totalInstanceCount><availableInstanceCount>0</availableInstanceCount>"
            f"<state>{block.state}</state><startDate>{_ec2_time(block.start_unix)}</startDate>"
            f"<endDate>{_ec2_time(block.end_unix)}</endDate><endDateType>limited"
            "</endDateType><instanceMatchCriteria>targeted</instanceMatchCriteria>"
            f"<createDate>{_ec2_time(block.start_unix - 86400)}</createDate>"
            f"<reservationType>{escape(block.type)}</reservationType></item>")
