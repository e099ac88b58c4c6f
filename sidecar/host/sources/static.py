"""A fixed deadline given on the command line (``--source static --expires-at TIME``).

For hosts without API access, for tests and for the demo. An unparsable value is
rejected at start-up by the configuration, so ``poll`` only fails on programming errors.
A value without a UTC offset is the operator's own input: it is refused (at start-up, by
the configuration) unless ``--timezone`` says which zone it is in, never guessed.
"""

from __future__ import annotations

from datetime import timezone, tzinfo
from typing import Any, Optional

from sidecar.host.sources.base import Observation, SourceError
from sidecar.models import KIND_SCHEDULED_RELEASE
from sidecar.timeparse import TimestampError, parse_timestamp


class StaticSource:
    name = "static"

    def __init__(self, expires_at: str, naive_timezone: Optional[tzinfo] = None) -> None:
        self._expires_at = expires_at
        self._naive_timezone = naive_timezone

    def poll(self) -> Observation:
        try:
            parsed = parse_timestamp(self._expires_at,
                                     naive_timezone=self._naive_timezone or timezone.utc)
        except TimestampError as exc:
            raise SourceError(str(exc)) from None
        if parsed.assumed_timezone is not None and self._naive_timezone is None:
            raise SourceError(f"{self._expires_at!r} has no UTC offset and no --timezone "
                              "is set: add one (Z for UTC, or +08:00)")
        return Observation(
            expires_at_unix=parsed.unix,
            kind=KIND_SCHEDULED_RELEASE,
            assumed_timezone=parsed.assumed_timezone,
        )


def from_settings(settings: Any) -> StaticSource:
    return StaticSource(settings.expires_at, naive_timezone=settings.naive_timezone)
