"""AWS EC2 Capacity Blocks for ML: when EC2 starts terminating this instance because its
Capacity Block ends.

One poll:

1. instance id and region from the instance metadata service (IMDSv2: a session token,
   then ``meta-data/instance-id`` and ``meta-data/placement/region``), asked once;
2. ``DescribeInstances`` (this instance) -> its ``CapacityReservationId``, cached once the
   reservation is known to be a Capacity Block;
3. ``DescribeCapacityReservations`` (that reservation) -> ``ReservationType`` and
   ``EndDate``, every poll: an extension of the block moves ``EndDate`` later, and the
   served deadline with it (a renewal).

The deadline served is ``EndDate`` less :data:`TERMINATION_LEAD_SECONDS`: EC2 begins to
terminate the block's instances thirty minutes before it ends (docs/sources.md cites the
page). An instance outside any reservation, or in a reservation that is no Capacity
Block, says so once and leaves the deadline to the other sources (``SourceAbsent``).

botocore signs the calls (SigV4) with its own credential chain (environment, shared
files, the instance role from the same metadata service); it is imported when the source
is built, so a host without it is told so in one line. The calls are bounded: botocore's
own retries off (the poller owns the backoff), connect and read timeouts, and each call as
a whole within :data:`CALL_SECONDS` (an endpoint that trickles costs one poll). Polled on
the adaptive schedule within the host's API budget: four calls an hour while the end is
hours away, one every --poll-interval in its last fifteen minutes (docs/polling.md).
"""

from __future__ import annotations

import logging
import re
import threading
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Callable, Optional

from sidecar.host.sources.aws import AwsConfig
from sidecar.host.sources.aws import probe as imds_probe
from sidecar.host.sources.base import (
    Observation,
    SourceAbsent,
    SourceError,
    SourceRefused,
    where,
)
from sidecar.host.sources.bounded import Calls, Unfinished
from sidecar.host.sources.metadata_http import clip, request
from sidecar.host.sources.spec import (
    Option,
    SourceSpec,
    SourceTraits,
    parse_url,
)
from sidecar.models import (
    DEFAULT_AWS_IMDS_URL,
    KIND_SCHEDULED_RELEASE,
    Notice,
    observation_from_notices,
)

__all__ = ["NOTICE_SECONDS", "SPEC", "TERMINATION_LEAD_SECONDS", "CapacityBlockConfig",
           "CapacityBlockSource", "build", "probe"]

log = logging.getLogger("sidecar.host.sources.aws_capacity_block")

# "Thirty minutes before the reservation expires, we begin to terminate any instances
# that are still running in the Capacity Block" (Work with Capacity Blocks, EC2 guide).
TERMINATION_LEAD_SECONDS = 30 * 60.0
# How long before its deadline this source learns it, for the protection verdict: a
# Capacity Block's end is known from its purchase, and the shortest block is one day;
# an instance launched into it late still sees the end at its first poll.
NOTICE_SECONDS = 24 * 3600.0 - TERMINATION_LEAD_SECONDS
CAPACITY_BLOCK = "capacity-block"  # ReservationType of a Capacity Block
# An instance outside any Capacity Block is asked again this rarely: it cannot join one
# while it runs (a reservation is chosen at launch), so the hourly re-ask is two calls.
NOT_IN_BLOCK_RETRY_SECONDS = 3600.0
CONNECT_SECONDS = 3.0
READ_SECONDS = 5.0
CALL_SECONDS = CONNECT_SECONDS + READ_SECONDS + 1.0  # one call as a whole
TOKEN_TTL_SECONDS = 300  # IMDS is read at start only: a short-lived token is enough
INSTANCE_ID_PATH = "/latest/meta-data/instance-id"
REGION_PATH = "/latest/meta-data/placement/region"
_METADATA_VALUE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
NO_CREDENTIALS = ("no AWS credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, a "
                  "profile (AWS_PROFILE), or attach an instance role allowed "
                  "ec2:DescribeInstances and ec2:DescribeCapacityReservations")
NO_BOTOCORE = ("the aws-capacity-block source needs botocore: pip install "
               "'esi-sidecar[aws]'")
_THROTTLED_CODES = ("RequestLimitExceeded", "Throttling", "ThrottlingException")
_REFUSED_CODES = ("AuthFailure", "UnauthorizedOperation", "InvalidClientTokenId",
                  "SignatureDoesNotMatch", "OptInRequired", "Blocked", "AccessDenied",
                  "InvalidAction", "UnrecognizedClientException")


class CapacityBlockSource:
    """Serves the moment EC2 starts terminating this instance's Capacity Block."""

    name = "aws-capacity-block"

    def __init__(self, imds_url: str = DEFAULT_AWS_IMDS_URL, *, allow_imdsv1: bool = False,
                 ec2_endpoint: Optional[str] = None,
                 call_seconds: float = CALL_SECONDS) -> None:
        import urllib3  # lazily: the settings table imports every source module
        self._imds_url = imds_url.rstrip("/")
        self._allow_imdsv1 = allow_imdsv1
        self._ec2_endpoint = ec2_endpoint.rstrip("/") if ec2_endpoint else None
        self._call_seconds = call_seconds
        self._imds_timeout = urllib3.Timeout(connect=0.5, read=1.0)
        self._http = urllib3.PoolManager(retries=False, timeout=self._imds_timeout)
        self._instance_id: Optional[str] = None
        self._region: Optional[str] = None
        self._session: Any = None
        self._client: Any = None
        self._reservation_id: Optional[str] = None  # once known to be a Capacity Block
        self._lock = threading.Lock()
        self._calls = Calls("esi-sidecar-ec2")  # each call bounded as a whole

    # ------------------------------------------------------------------ the poll

    def poll(self) -> Observation:
        with self._lock:
            try:
                return self._poll()
            except (SourceError, SourceAbsent):
                raise
            except Exception as exc:  # a bug here must not take the poller down
                message = f"unexpected {type(exc).__name__} {where(exc)}"
                log.warning("%s source: %s", self.name, message)
                raise SourceError(message) from None

    def _poll(self) -> Observation:
        client = self._ec2()
        reservation_id = self._reservation_id or self._lookup_reservation(client)
        reservation = self._describe_reservation(client, reservation_id)
        kind = str(reservation.get("ReservationType") or "default")
        if kind != CAPACITY_BLOCK:
            self._reservation_id = None
            raise SourceAbsent(f"instance {self._instance_id} runs in capacity reservation "
                               f"{reservation_id}, a {clip(kind, 40)} reservation, not a "
                               "Capacity Block", retry_after=NOT_IN_BLOCK_RETRY_SECONDS)
        if self._reservation_id is None:
            log.info("instance %s runs in Capacity Block %s", self._instance_id, reservation_id)
        self._reservation_id = reservation_id
        end = _end_unix(reservation.get("EndDate"), reservation_id)
        state = clip(str(reservation.get("State", "?")), 30)
        notice = Notice(KIND_SCHEDULED_RELEASE, end - TERMINATION_LEAD_SECONDS,
                        detail=f"capacity block {reservation_id} ({state}) ends "
                               f"{_rfc3339(end)}; EC2 terminates from "
                               f"{TERMINATION_LEAD_SECONDS / 60:g} min before")
        return observation_from_notices([notice], instance_id=self._instance_id)

    def _lookup_reservation(self, client: Any) -> str:
        answer = self._call("DescribeInstances", lambda: client.describe_instances(
            InstanceIds=[self._instance_id]))
        instances = [i for r in answer.get("Reservations") or [] if isinstance(r, dict)
                     for i in r.get("Instances") or [] if isinstance(i, dict)]
        match = next((i for i in instances if i.get("InstanceId") == self._instance_id), None)
        if match is None:
            raise SourceError(f"DescribeInstances: instance {self._instance_id} not in the "
                              f"answer for {self._region}")
        found = match.get("CapacityReservationId")
        if not found:
            raise SourceAbsent(f"instance {self._instance_id} runs outside any capacity "
                               "reservation: not in a Capacity Block",
                               retry_after=NOT_IN_BLOCK_RETRY_SECONDS)
        return str(found)

    def _describe_reservation(self, client: Any, reservation_id: str) -> dict[str, Any]:
        answer = self._call("DescribeCapacityReservations",
                            lambda: client.describe_capacity_reservations(
                                CapacityReservationIds=[reservation_id]))
        items = [r for r in answer.get("CapacityReservations") or [] if isinstance(r, dict)]
        match = next((r for r in items if r.get("CapacityReservationId") == reservation_id),
                     None)
        if match is None:
            raise SourceError(f"DescribeCapacityReservations: reservation {reservation_id} "
                              "not in the answer")
        return match

    # ------------------------------------------------------------------ IMDSv2

    def _identity(self) -> tuple[str, str]:
        """(instance id, region) from IMDSv2 (IMDSv1 only when --aws-imdsv1 allows)."""
        response = self._imds("PUT", "/latest/api/token",
                              {"X-aws-ec2-metadata-token-ttl-seconds": str(TOKEN_TTL_SECONDS)})
        token = response.data.decode("ascii", "replace").strip()
        headers: dict[str, str] = {}
        if response.status == 200 and token:
            headers = {"X-aws-ec2-metadata-token": token}
        elif not (self._allow_imdsv1 and response.status in (403, 404, 405)):
            raise SourceError(f"IMDSv2 session token: HTTP {response.status} from "
                              f"{self._imds_url} (IMDSv1 is not used unless --aws-imdsv1 true)")
        values = []
        for path in (INSTANCE_ID_PATH, REGION_PATH):
            answer = self._imds("GET", path, headers)
            text = answer.data.decode("utf-8", "replace").strip()
            if answer.status != 200 or not _METADATA_VALUE.match(text):
                why = f"HTTP {answer.status}" if answer.status != 200 else clip(text, 40)
                raise SourceError(f"IMDS {path}: {why}")
            values.append(text)
        return values[0], values[1]

    def _imds(self, method: str, path: str, headers: dict[str, str]) -> Any:
        return request(self._http, method, self._imds_url + path, headers=headers,
                       place=f"IMDS at {self._imds_url}", cloud="EC2",
                       timeout=self._imds_timeout)

    # ------------------------------------------------------------------ EC2 API

    def _ec2(self) -> Any:
        """The botocore EC2 client, built once credentials resolve (asked every poll
        until they do, so an instance role attached later is picked up). Credentials are
        asked before the metadata service: a host without them is told so first."""
        if self._client is not None:
            return self._client
        try:
            import botocore.session
            from botocore.config import Config
        except ImportError:
            raise SourceRefused(NO_BOTOCORE) from None
        if self._session is None:
            session = botocore.session.Session()
            # The instance role comes from the metadata service this source reads.
            session.set_config_variable("ec2_metadata_service_endpoint", self._imds_url + "/")
            if not self._allow_imdsv1:
                session.set_config_variable("ec2_metadata_v1_disabled", True)
            self._session = session
        try:
            credentials = self._session.get_credentials()
        except Exception as exc:  # a broken profile file, say
            raise SourceRefused(f"AWS credentials: {type(exc).__name__}: "
                                f"{clip(str(exc), 160)}") from None
        if credentials is None:
            raise SourceRefused(NO_CREDENTIALS)
        if self._instance_id is None or self._region is None:
            self._instance_id, self._region = self._identity()
            log.info("instance %s in %s (from the metadata service)", self._instance_id,
                     self._region)
        config = Config(connect_timeout=CONNECT_SECONDS, read_timeout=READ_SECONDS,
                        retries={"total_max_attempts": 1, "mode": "standard"})
        self._client = self._session.create_client(
            "ec2", region_name=self._region, endpoint_url=self._ec2_endpoint, config=config)
        return self._client

    def _call(self, action: str, call: Callable[[], Any]) -> dict[str, Any]:
        """One API call, bounded as a whole; its failures as one SourceError line."""
        try:
            answer = self._calls.run(
                call, self._call_seconds,
                busy=f"{action}: the previous call has not ended yet (the endpoint "
                     "trickles its answer)",
                late=f"{action}: no whole answer within {self._call_seconds:g} s")
        except Unfinished:
            raise
        except Exception as exc:
            raise self._translate(action, exc) from None
        if not isinstance(answer, dict):
            raise SourceError(f"{action}: malformed response")
        return answer

    def _translate(self, action: str, exc: Exception) -> Exception:
        from botocore import exceptions as boto
        from botocore.parsers import ResponseParserError

        where_to = self._ec2_endpoint or f"the EC2 endpoint for {self._region}"
        if isinstance(exc, boto.ClientError):
            error = exc.response.get("Error") or {}
            code = str(error.get("Code") or "")
            message = clip(str(error.get("Message") or ""), 160)
            status = (exc.response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
            text = f"{action}: HTTP {status} {code}: {message}"
            if status == 429 or code in _THROTTLED_CODES:
                return SourceError(text, throttled=True)
            if status in (401, 403) or code in _REFUSED_CODES:
                return SourceRefused(text)
            return SourceError(text)
        if isinstance(exc, boto.NoCredentialsError):
            return SourceRefused(NO_CREDENTIALS)
        if isinstance(exc, ResponseParserError):
            return SourceError(f"{action}: malformed response (not EC2's XML)")
        if isinstance(exc, (boto.ConnectTimeoutError, boto.ReadTimeoutError)):
            return SourceError(f"{action}: no answer from {where_to} in time")
        if isinstance(exc, boto.EndpointConnectionError):
            return SourceError(f"{action}: cannot connect to {where_to}")
        if isinstance(exc, boto.BotoCoreError):
            return SourceError(f"{action}: {type(exc).__name__} reaching {where_to}")
        return SourceError(f"{action}: unexpected {type(exc).__name__} {where(exc)}")


def _end_unix(value: Any, reservation_id: str) -> float:
    """EndDate as Unix seconds: botocore parses EC2's timestamp into an aware datetime."""
    if isinstance(value, datetime) and value.tzinfo is not None:
        return value.timestamp()
    raise SourceError(f"DescribeCapacityReservations: reservation {reservation_id} has no "
                      f"EndDate we understand: {clip(str(value), 60)}")


def _rfc3339(unix: float) -> str:
    return datetime.fromtimestamp(unix, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class CapacityBlockConfig:
    aws_imds_url: str
    aws_imdsv1: bool
    aws_ec2_endpoint: Optional[str]


def build(config: CapacityBlockConfig) -> CapacityBlockSource:
    return CapacityBlockSource(config.aws_imds_url, allow_imdsv1=config.aws_imdsv1,
                               ec2_endpoint=config.aws_ec2_endpoint)


def probe(config: CapacityBlockConfig, timeout: float) -> Optional[str]:
    """None when an EC2 metadata service answers here (whether the instance runs in a
    Capacity Block, the first poll asks EC2), else why not, in one line."""
    return imds_probe(AwsConfig(config.aws_imds_url, config.aws_imdsv1), timeout)


SPEC = SourceSpec(
    name="aws-capacity-block", config=CapacityBlockConfig, build=build, probe=probe,
    summary="the end of an EC2 Capacity Block", aliases=("capacity-block",),
    # An AWS instance runs it beside the aws source: under auto, no credentials (or a
    # policy without the two Describe actions) skips it with the reason.
    traits=SourceTraits(adaptive=True, api_budget=True, optional=True),
    options=(
        Option("aws_ec2_endpoint", parse_url, "EC2 API endpoint for the aws-capacity-block "
               "source (default: botocore's endpoint for the instance's region); a URL such "
               "as http://127.0.0.1:9000 points at the emulator", "URL"),
    ),
)
