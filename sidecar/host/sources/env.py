"""The capacity-block variables that some platforms set for the job.

``MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP`` (Volcengine ML platform, and the
seed install script) and ``SAGEMAKER_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP`` (AWS),
in that order, in seconds or milliseconds. The daemon's own environment is read at each
poll, so a value changed by the service manager's reload is picked up.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timezone, tzinfo
from typing import Optional

from sidecar.host.sources.base import Observation, SourceError
from sidecar.host.sources.spec import SourceSpec
from sidecar.models import DEADLINE_PROCESS, KIND_SCHEDULED_RELEASE
from sidecar.timeparse import VOLCENGINE_TIMEZONE, TimestampError, parse_timestamp

ENV_NAMES = (
    "MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP",
    "SAGEMAKER_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP",
)
# A date-time without an offset is read in its platform's zone (issue 13): Volcengine's
# (UTC+8, the earliest reading), and UTC for AWS, whose services write UTC.
NAIVE_TIMEZONES: dict[str, tzinfo] = {
    "MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP": VOLCENGINE_TIMEZONE,
    "SAGEMAKER_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP": timezone.utc,
}


class EnvSource:
    name = "env"

    def __init__(self, environ: Optional[Mapping[str, str]] = None,
                 naive_timezone: Optional[tzinfo] = None) -> None:
        """``naive_timezone``: the zone for times without an offset (--timezone); None:
        each variable's platform's (``NAIVE_TIMEZONES``)."""
        self._environ = os.environ if environ is None else environ
        self._naive_timezone = naive_timezone

    def poll(self) -> Observation:
        for env_name in ENV_NAMES:
            value = self._environ.get(env_name, "").strip()
            if not value:
                continue
            zone = self._naive_timezone or NAIVE_TIMEZONES[env_name]
            try:
                parsed = parse_timestamp(value, naive_timezone=zone)
            except TimestampError as exc:
                raise SourceError(f"{env_name}: {exc}") from None
            return Observation(
                expires_at_unix=parsed.unix,
                kind=KIND_SCHEDULED_RELEASE,
                assumed_timezone=parsed.assumed_timezone,
            )
        # Neither is set: no capacity block, hence no scheduled release. Not an error.
        return Observation(expires_at_unix=None)


@dataclass(frozen=True)
class EnvConfig:
    naive_timezone: Optional[tzinfo]  # --timezone


def build(config: EnvConfig) -> EnvSource:
    return EnvSource(naive_timezone=config.naive_timezone)


# The capacity block's end as the job's environment gives it: a process's deadline, as the
# guard has always read it (one save, then leave).
SPEC = SourceSpec(name="env", config=EnvConfig, build=build, deadline_kind=DEADLINE_PROCESS)
