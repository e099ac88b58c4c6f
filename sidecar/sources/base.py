"""The Source protocol: poll once, return what was seen, or raise SourceError.

A source never schedules, retries or sleeps: ``sidecar.poller`` owns the schedule, the
backoff and the staleness. One module per source; ``sidecar.sources`` maps names to them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol, runtime_checkable

__all__ = ["Observation", "Source", "SourceError"]


@dataclass(frozen=True)
class Observation:
    """One successful poll. ``expires_at_unix`` is None when no release is scheduled."""

    expires_at_unix: Optional[float]
    kind: Optional[str] = None
    instance_id: Optional[str] = None
    scheduled_instance_id: Optional[str] = None
    # Set when the source gave a timestamp without an offset and we assumed this zone.
    assumed_timezone: Optional[str] = None


class SourceError(Exception):
    """A failed poll. The message is one line, free of secrets, fit for ``error``.

    ``throttled`` marks rate limiting (HTTP 429, ``Throttling*``/``FlowLimit*`` codes):
    the poller backs off from it like from any failure, but counts it apart.
    """

    def __init__(self, message: str, *, throttled: bool = False) -> None:
        super().__init__(message)
        self.throttled = throttled


@runtime_checkable
class Source(Protocol):
    """One place that knows when this machine goes away."""

    name: str

    def poll(self) -> Observation:
        """Ask once. Return an Observation or raise SourceError; never sleep or retry."""
        ...
