"""A fixed deadline given on the command line (``--source static --expires-at TIME``).

For hosts without API access, for tests and for the demo. An unparsable value is
rejected at start-up by the configuration, so ``poll`` only fails on programming errors.
"""

from __future__ import annotations

from typing import Any

from sidecar.host.sources.base import Observation, SourceError
from sidecar.models import KIND_SCHEDULED_RELEASE
from sidecar.timeparse import TimestampError, parse_timestamp


class StaticSource:
    name = "static"

    def __init__(self, expires_at: str, **parse_options: Any) -> None:
        self._expires_at = expires_at
        self._parse_options = parse_options

    def poll(self) -> Observation:
        try:
            parsed = parse_timestamp(self._expires_at, **self._parse_options)
        except TimestampError as exc:
            raise SourceError(str(exc)) from None
        return Observation(
            expires_at_unix=parsed.unix,
            kind=KIND_SCHEDULED_RELEASE,
            assumed_timezone=parsed.assumed_timezone,
        )


def from_settings(settings: Any) -> StaticSource:
    return StaticSource(settings.expires_at, naive_timezone=settings.naive_timezone)
