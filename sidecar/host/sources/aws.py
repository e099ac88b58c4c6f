"""AWS EC2: spot interruption notices and scheduled maintenance, from the instance
metadata service (IMDS), version 2.

Every poll (every 2 s, as AWS advises for the two-minute spot notice):

- ``PUT /latest/api/token`` with ``X-aws-ec2-metadata-token-ttl-seconds`` gives a session
  token; it is kept until a minute before its TTL ends, and fetched again on a 401.
  IMDSv1 (no token) is used only when ``--aws-imdsv1 true`` allows it and the token
  request is refused.
- ``GET /latest/meta-data/spot/instance-action``: 404 while nothing is planned; then
  ``{"action": "terminate" | "stop" | "hibernate", "time": "2026-12-01T08:22:00Z"}``,
  the moment the instance goes: served as a preemption notice.
- ``GET /latest/meta-data/events/maintenance/scheduled``: a JSON list of events; each
  one not ``completed`` or ``canceled`` has a ``NotBefore`` ("21 Jan 2019 09:00:43 GMT"):
  the earliest is served as scheduled maintenance.
- ``GET /latest/meta-data/events/recommendations/rebalance``: ``{"noticeTime": ...}`` is
  advice that the instance is at elevated risk, not a deadline: logged once, listed in
  ``notices`` as advisory, never the deadline.

urllib3 (already installed with the Volcengine SDK) does the HTTP, with no proxy: the
metadata service is link-local. Short timeouts (0.5 s connect, 1 s read): a hung service
costs one poll, and a host that is not on EC2 fails fast.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from datetime import timezone
from typing import Any, Callable, Optional

from sidecar.host.sources.base import Observation, SourceError
from sidecar.host.sources.metadata_http import clip, probe_failure, request
from sidecar.host.sources.spec import (
    Option,
    SourceSpec,
    SourceTraits,
    parse_boolean,
    parse_url,
)
from sidecar.models import (
    DEFAULT_AWS_IMDS_URL,
    KIND_MAINTENANCE,
    KIND_PREEMPTION,
    KIND_REBALANCE,
    Notice,
    observation_from_notices,
)
from sidecar.timeparse import TimestampError, parse_http_date, parse_timestamp

__all__ = ["SPEC", "AwsConfig", "AwsSource", "build", "probe"]

log = logging.getLogger("sidecar.host.sources.aws")

TOKEN_TTL_SECONDS = 21600  # the longest IMDS allows: six hours
TOKEN_REFRESH_SECONDS = 60.0  # fetch a new token this long before the old one ends
POLL_INTERVAL_SECONDS = 2.0
SPOT_PATH = "/latest/meta-data/spot/instance-action"
MAINTENANCE_PATH = "/latest/meta-data/events/maintenance/scheduled"
REBALANCE_PATH = "/latest/meta-data/events/recommendations/rebalance"
INSTANCE_ID_PATH = "/latest/meta-data/instance-id"
_DONE_STATES = ("completed", "canceled", "cancelled")


class AwsSource:
    name = "aws"
    #: The poller polls this source this often, whatever --poll-interval says.
    poll_interval_seconds = POLL_INTERVAL_SECONDS

    def __init__(
        self,
        url: str = DEFAULT_AWS_IMDS_URL,
        *,
        allow_imdsv1: bool = False,
        connect_timeout: float = 0.5,
        read_timeout: float = 1.0,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        import urllib3  # lazily: the settings table imports every source module
        self._url = url.rstrip("/")
        self._allow_imdsv1 = allow_imdsv1
        self._timeout = urllib3.Timeout(connect=connect_timeout, read=read_timeout)
        self._http = urllib3.PoolManager(retries=False, timeout=self._timeout)
        self._monotonic = monotonic
        self._token: Optional[str] = None
        self._token_until = 0.0
        self._v1 = False  # the token request was refused and IMDSv1 is allowed
        self._instance_id: Optional[str] = None
        self._rebalance_seen: Optional[str] = None

    # ------------------------------------------------------------------ poll

    def poll(self) -> Observation:
        spot = self._get_json(SPOT_PATH, "spot instance-action")
        maintenance = self._get_json(MAINTENANCE_PATH, "scheduled maintenance")
        notices = []
        if spot is not None:
            notices.append(Notice(KIND_PREEMPTION, _spot_time(spot),
                                  detail=f"spot {clip(str(spot.get('action', '?')), 20)}"))
        if maintenance is not None:
            notices.extend(_maintenance_notices(maintenance))
        rebalance = self._rebalance()
        if rebalance is not None:
            notices.append(rebalance)
        if self._instance_id is None:
            status, body = self._get(INSTANCE_ID_PATH)
            if status == 200 and body.strip():
                self._instance_id = body.strip()
        return observation_from_notices(notices, instance_id=self._instance_id)

    def _rebalance(self) -> Optional[Notice]:
        """Advice, not a deadline: listed as advisory, one log line per new notice."""
        try:
            notice = self._get_json(REBALANCE_PATH, "rebalance recommendation")
        except SourceError:
            return None  # advisory only: never fails the poll
        text = None if notice is None else str(notice.get("noticeTime", notice)
                                                if isinstance(notice, dict) else notice)
        if text is not None and text != self._rebalance_seen:
            log.warning("AWS rebalance recommendation (%s): this spot instance is at elevated "
                        "risk of interruption; no deadline yet", text)
        self._rebalance_seen = text
        if text is None:
            return None
        return Notice(KIND_REBALANCE, None, advisory=True,
                      detail=f"rebalance recommended at {clip(text, 40)}")

    # ------------------------------------------------------------------ HTTP

    def _get_json(self, path: str, what: str) -> Any:
        """The JSON body at ``path``; None on 404 (nothing planned)."""
        status, body = self._get(path)
        if status == 404:
            return None
        if status != 200:
            raise SourceError(f"IMDS {what}: HTTP {status} from {self._url}{path}")
        try:
            return json.loads(body)
        except ValueError:
            raise SourceError(f"IMDS {what}: not JSON: {clip(body)}") from None

    def _get(self, path: str) -> tuple[int, str]:
        """GET with the session token; a 401 fetches a new token and tries once more."""
        for attempt in (1, 2):
            token = None if self._v1 else self._session_token()
            headers = {} if self._v1 or token is None else {"X-aws-ec2-metadata-token": token}
            response = self._request("GET", path, headers)
            if response.status == 401 and attempt == 1 and not self._v1:
                self._token = None  # expired or revoked: a new one, then again
                continue
            if response.status == 401:
                raise SourceError(f"IMDS refused the session token (HTTP 401) at {path}")
            return response.status, response.data.decode("utf-8", "replace")
        raise AssertionError("unreachable")

    def _session_token(self) -> str:
        if self._token is not None and self._monotonic() < self._token_until:
            return self._token
        response = self._request(
            "PUT", "/latest/api/token",
            {"X-aws-ec2-metadata-token-ttl-seconds": str(TOKEN_TTL_SECONDS)},
        )
        token = response.data.decode("ascii", "replace").strip()
        if response.status == 200 and token:
            self._token = token
            self._token_until = self._monotonic() + TOKEN_TTL_SECONDS - TOKEN_REFRESH_SECONDS
            return token
        if self._allow_imdsv1 and response.status in (403, 404, 405):
            log.warning("IMDSv2 token refused (HTTP %s); using IMDSv1 as --aws-imdsv1 allows",
                        response.status)
            self._v1 = True
            return ""
        raise SourceError(f"IMDSv2 session token: HTTP {response.status} from {self._url} "
                          "(IMDSv1 is not used unless --aws-imdsv1 true)")

    def _request(self, method: str, path: str, headers: dict[str, str]) -> Any:
        return request(self._http, method, self._url + path, headers=headers,
                       place=f"IMDS at {self._url}", cloud="EC2", timeout=self._timeout)


def _spot_time(notice: Any) -> float:
    if not isinstance(notice, dict) or "time" not in notice:
        raise SourceError(f"IMDS spot instance-action without a time: {clip(notice)}")
    try:
        # EC2 documents UTC ("2015-01-05T18:02:00Z"): a time without an offset is UTC.
        return parse_timestamp(notice["time"], naive_timezone=timezone.utc).unix
    except TimestampError as exc:
        raise SourceError(f"IMDS spot instance-action: {exc}") from None


def _maintenance_notices(events: Any) -> list[Notice]:
    if not isinstance(events, list):
        raise SourceError(f"IMDS scheduled maintenance is not a list: {clip(events)}")
    notices = []
    for event in events:
        if not isinstance(event, dict):
            raise SourceError(f"IMDS scheduled maintenance event: {clip(event)}")
        if str(event.get("State", "")).lower() in _DONE_STATES:
            continue
        code = clip(str(event.get("Code", "maintenance")), 40)
        try:
            when = parse_http_date(str(event.get("NotBefore", ""))).unix
        except TimestampError as exc:
            raise SourceError(f"IMDS scheduled maintenance {code}: {exc}") from None
        notices.append(Notice(KIND_MAINTENANCE, when, detail=code))
    return notices



@dataclass(frozen=True)
class AwsConfig:
    aws_imds_url: str
    aws_imdsv1: bool


def probe(config: AwsConfig, timeout: float) -> Optional[str]:
    """None when an EC2 metadata service answers at the configured address (for
    ``--source auto``), else why not, in one line."""
    import urllib3  # lazily: the settings table imports every source module
    url = config.aws_imds_url.rstrip("/")
    http = urllib3.PoolManager(retries=False, timeout=urllib3.Timeout(total=timeout))
    try:
        response = http.request("PUT", url + "/latest/api/token", redirect=False,
                                headers={"X-aws-ec2-metadata-token-ttl-seconds": "60"})
        if response.status == 200 and response.data.strip():
            return None
        if config.aws_imdsv1 and response.status in (403, 404, 405):
            response = http.request("GET", url + INSTANCE_ID_PATH, redirect=False)
            if response.status == 200 and response.data.strip():
                return None
        return f"no EC2 metadata service at {url} (token request: HTTP {response.status})"
    except urllib3.exceptions.HTTPError as exc:
        return f"no EC2 metadata service at {url} ({probe_failure(exc, timeout)})"
    finally:
        http.clear()



def build(config: AwsConfig) -> AwsSource:
    return AwsSource(config.aws_imds_url, allow_imdsv1=config.aws_imdsv1)


SPEC = SourceSpec(
    name="aws", config=AwsConfig, build=build, probe=probe,
    summary="EC2 spot notices and maintenance", aliases=("ec2", "aws-spot"),
    notice_seconds=120.0,  # the spot interruption notice: two minutes
    traits=SourceTraits(poll_interval_seconds=POLL_INTERVAL_SECONDS),
    options=(
        Option("aws_imds_url", parse_url, f"AWS instance metadata service for the aws source "
               f"(default {DEFAULT_AWS_IMDS_URL})", "URL"),
        Option("aws_imdsv1", parse_boolean, "let the aws source fall back to IMDSv1 (no session "
               "token) when the token request is refused: true or false (default false)",
               "BOOL"),
    ),
)
