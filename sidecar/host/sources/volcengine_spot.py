"""Volcengine spot reclaim from the ECS metadata service: no credentials, no API calls.

``GET {--metadata-url}/latest/spot_instance_termination_time`` (the ECS spot guide,
"查看抢占式实例中断事件"; docs/sources.md) answers 404 until the five-minute interruption
notice starts, then the reclaim time as plain text, in UTC by the guide. Served as a
preemption notice; 404 is a healthy "nothing planned".

Polled every 1.8 s (its own cadence, whatever --poll-interval says; the poller's +-10 %
jitter keeps every gap under 2 s): a reclaim is learned with at least 4 min 58 s left,
where ``DescribeSystemEvents`` every 30 s (the volcengine-events source) may leave 4.5
min. 2,000 requests per host-hour, all to the link-local metadata service (no API calls,
no credentials); the instance id is asked once.

A time with an offset (``Z``, ``+08:00``) is taken as written. One without is read in the
earliest plausible zone, so that a wrong guess saves early, never late: UTC+8 (the zone
the ECS API writes, and the east edge of Volcengine's regions) unless that reading lies
more than ``PLAUSIBLE_PAST_SECONDS`` in the past, which a notice shown at most five
minutes ahead cannot; then UTC, the zone the guide names. ``--timezone`` overrides both.

Each request is bounded as a whole (a timer ends it at its deadline, whatever it waits
for: ``bounded.Deadline``), so a service that hangs or trickles its answer costs one
poll, never more.
"""

from __future__ import annotations

import re
import socket
import time
from dataclasses import dataclass
from datetime import timezone, tzinfo
from http.client import HTTPConnection, HTTPException
from typing import Callable, Optional
from urllib.parse import urlsplit

from sidecar.host.sources.base import Observation, SourceError
from sidecar.host.sources.bounded import Deadline
from sidecar.host.sources.metadata_http import clip
from sidecar.host.sources.spec import SourceSpec, SourceTraits
from sidecar.models import DEFAULT_METADATA_URL, KIND_PREEMPTION, Notice, observation_from_notices
from sidecar.timeparse import VOLCENGINE_TIMEZONE, ParsedTime, TimestampError, parse_timestamp

__all__ = ["SPEC", "SpotTerminationSource", "VolcengineSpotConfig", "build", "probe",
           "read_termination_time"]

SPOT_PATH = "/latest/spot_instance_termination_time"
INSTANCE_ID_PATH = "/latest/instance_id"
POLL_INTERVAL_SECONDS = 1.8  # +10 % jitter: still under 2 s
REQUEST_SECONDS = 1.5  # one whole request: connect, send, every read
MAX_BODY = 256  # a timestamp is ~25 bytes; more is not the answer we expect
# A naive time read as UTC+8 that lies further back than this cannot be a notice shown
# five minutes ahead: it was written in UTC, as the guide says.
PLAUSIBLE_PAST_SECONDS = 3600.0
_NAIVE_ZONES = (VOLCENGINE_TIMEZONE, timezone.utc)  # earliest reading first
_INSTANCE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")


class SpotTerminationSource:
    """Reads the spot reclaim time from the ECS metadata service."""

    name = "volcengine-spot"
    #: The poller polls this source this often, whatever --poll-interval says.
    poll_interval_seconds = POLL_INTERVAL_SECONDS

    def __init__(self, metadata_url: str = DEFAULT_METADATA_URL, *,
                 naive_timezone: Optional[tzinfo] = None,
                 request_seconds: float = REQUEST_SECONDS,
                 clock: Callable[[], float] = time.time) -> None:
        self._url = metadata_url.rstrip("/")
        self._naive_timezone = naive_timezone
        self._request_seconds = request_seconds
        self._clock = clock
        self._instance_id: Optional[str] = None

    def poll(self) -> Observation:
        status, body = bounded_get(self._url + SPOT_PATH, self._request_seconds)
        if self._instance_id is None:
            self._instance_id = self._ask_instance_id()
        if status == 404:
            return Observation(expires_at_unix=None, instance_id=self._instance_id)
        if status != 200:
            raise SourceError(f"metadata service {self._url}{SPOT_PATH}: HTTP {status}")
        try:
            parsed = read_termination_time(body, self._clock(), self._naive_timezone)
        except TimestampError as exc:
            raise SourceError(f"metadata service {SPOT_PATH}: {exc}") from None
        notice = Notice(KIND_PREEMPTION, parsed.unix, detail=f"spot reclaim at {clip(body, 40)}")
        return observation_from_notices([notice], instance_id=self._instance_id,
                                        assumed_timezone=parsed.assumed_timezone)

    def _ask_instance_id(self) -> Optional[str]:
        """The instance id, for /v1/expiry; best effort: its failure never fails a poll."""
        try:
            status, body = bounded_get(self._url + INSTANCE_ID_PATH, self._request_seconds)
        except SourceError:
            return None
        return body if status == 200 and _INSTANCE_ID.match(body) else None


def read_termination_time(text: str, now: float,
                          naive_timezone: Optional[tzinfo] = None) -> ParsedTime:
    """The reclaim instant the service wrote; TimestampError for anything else. A time
    without an offset: in ``naive_timezone`` when set, else the earliest plausible zone."""
    if naive_timezone is not None:
        return parse_timestamp(text, naive_timezone=naive_timezone)
    for zone in _NAIVE_ZONES:
        parsed = parse_timestamp(text, naive_timezone=zone)
        if parsed.assumed_timezone is None:
            return parsed  # it carried its offset: no zone was guessed
        if parsed.unix >= now - PLAUSIBLE_PAST_SECONDS:
            return parsed
    return parse_timestamp(text, naive_timezone=_NAIVE_ZONES[0])  # long past either way


def bounded_get(url: str, seconds: float) -> tuple[int, str]:
    """(status, body text stripped) of one GET that ends within ``seconds`` in all: a
    timer shuts the socket at the deadline, so a trickled answer (headers or body) fails
    like a hung one. No proxy: the metadata service is link-local."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise SourceError(f"metadata service {url}: only http:// URLs are served")
    connection = HTTPConnection(parts.hostname, parts.port or 80, timeout=seconds)
    deadline = Deadline(seconds)
    try:
        with deadline:
            connection.connect()
            deadline.watch(connection.sock)
            if deadline.expired.is_set():
                raise TimeoutError
            connection.request("GET", parts.path or "/", headers={"Accept": "text/plain"})
            response = connection.getresponse()
            body = response.read(MAX_BODY + 1)
            status = response.status
    except ConnectionRefusedError:
        raise SourceError(f"metadata service {url}: cannot connect: not on Volcengine ECS?"
                          ) from None
    except (OSError, HTTPException) as exc:
        if deadline.expired.is_set() or isinstance(exc, (TimeoutError, socket.timeout)):
            raise SourceError(f"metadata service {url}: no answer within "
                              f"{seconds:g} s") from None
        raise SourceError(f"metadata service {url}: {type(exc).__name__}") from None
    finally:
        connection.close()
    if deadline.expired.is_set():  # cut mid-body: what came is not the whole answer
        raise SourceError(f"metadata service {url}: no answer within {seconds:g} s")
    if len(body) > MAX_BODY:
        raise SourceError(f"metadata service {url}: answer longer than {MAX_BODY} bytes: "
                          f"{clip(body.decode('utf-8', 'replace'))}")
    return status, body.decode("utf-8", "replace").strip()


@dataclass(frozen=True)
class VolcengineSpotConfig:
    metadata_url: str
    naive_timezone: Optional[tzinfo]  # --timezone; None: the earliest plausible zone


def build(config: VolcengineSpotConfig) -> SpotTerminationSource:
    return SpotTerminationSource(config.metadata_url or DEFAULT_METADATA_URL,
                                 naive_timezone=config.naive_timezone)


def probe(config: VolcengineSpotConfig, timeout: float) -> Optional[str]:
    """None when the ECS metadata service answers with an instance id, else why not."""
    url = (config.metadata_url or DEFAULT_METADATA_URL).rstrip("/") + INSTANCE_ID_PATH
    try:
        status, body = bounded_get(url, timeout)
    except SourceError as exc:
        return f"no ECS metadata service at {url} ({str(exc).split(url + ': ', 1)[-1]})"
    if status != 200:
        return f"no ECS metadata service at {url} (HTTP {status})"
    if not _INSTANCE_ID.match(body):
        return f"no ECS metadata service at {url} (unexpected answer {body[:40]!r})"
    return None


# Its one setting, --metadata-url, is the volcengine-esi source's row; no credentials.
SPEC = SourceSpec(
    name="volcengine-spot", config=VolcengineSpotConfig, build=build, probe=probe,
    summary="ECS spot reclaim from the metadata service",
    notice_seconds=300.0,  # the spot reclaim: five minutes
    traits=SourceTraits(poll_interval_seconds=POLL_INTERVAL_SECONDS),
)
