"""A fixed deadline given on the command line (``--source static --expires-at TIME``).

For hosts without API access, for tests and for the demo. An unparsable value is
rejected at start-up by the configuration, so ``poll`` only fails on programming errors.
A value without a UTC offset is the operator's own input: it is refused (at start-up, by
the configuration) unless ``--timezone`` says which zone it is in, never guessed.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timezone, tzinfo
from typing import Optional

from sidecar.host.sources.base import Observation, SourceError
from sidecar.host.sources.spec import Option, SourceSpec
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


@dataclass(frozen=True)
class StaticConfig:
    expires_at: str  # the configuration refuses to start the static source without it
    naive_timezone: Optional[tzinfo]  # --timezone


def build(config: StaticConfig) -> StaticSource:
    return StaticSource(config.expires_at, naive_timezone=config.naive_timezone)


def _timestamp(text: str) -> str:
    parse_timestamp(text)  # validate now, so a typo stops start-up rather than every poll
    return text.strip()


SPEC = SourceSpec(
    name="static", config=StaticConfig, build=build,
    options=(
        Option("expires_at", _timestamp, "the deadline for the static source: RFC 3339 or "
               "Unix seconds / milliseconds", "TIME"),
    ),
)
