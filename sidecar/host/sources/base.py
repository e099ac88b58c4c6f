"""The Source protocol: poll once, return what was seen, or raise SourceError.

A source never schedules, retries or sleeps: ``sidecar.host.poller`` owns the schedule,
the backoff and the staleness. One module per source, which declares itself in a
``SPEC`` (``sidecar.host.sources.spec``); ``sidecar.host.sources.registry`` maps names to
them.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Protocol, runtime_checkable

from sidecar.models import Observation

__all__ = ["Observation", "Source", "SourceAbsent", "SourceError", "SourceRefused", "SourceTraits",
           "where"]


class SourceError(Exception):
    """A failed poll. The message is one line, free of secrets, fit for ``error``.

    ``throttled`` marks rate limiting (HTTP 429, ``Throttling*``/``FlowLimit*`` codes):
    the poller backs off from it like from any failure, but counts it apart.
    """

    def __init__(self, message: str, *, throttled: bool = False) -> None:
        super().__init__(message)
        self.throttled = throttled


class SourceRefused(SourceError):
    """A definite no that asking again will not change until someone acts: no credentials,
    credentials refused, an action the account may not call (HTTP 403, ``AccessDenied``)
    or that the endpoint does not offer (``InvalidAction``). /healthz says degraded at
    once rather than ``starting``; ``--source auto`` skips an optional source refused so
    (issue 22, item 7; issue 26, item 4). Throttling, 5xx and timeouts are no refusal."""


class SourceAbsent(Exception):
    """This machine has no such service (``--source auto`` probed it): not an error. The
    message says why, in one line; the source is left out of the deadline and of health.
    ``retry_after``: when to ask again (None: the source's poll interval)."""

    def __init__(self, message: str, *, retry_after: Optional[float] = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


def where(exc: BaseException) -> str:
    """``(at file.py:123)`` for the innermost frame of an unexpected exception: enough to
    find the bug, with none of the exception's text (which may carry credentials)."""
    frames = traceback.extract_tb(exc.__traceback__)
    return f"(at {Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""


@runtime_checkable
class Source(Protocol):
    """One place that knows when this machine goes away."""

    name: str

    def poll(self) -> Observation:
        """Ask once. Return an Observation or raise SourceError; never sleep or retry."""
        ...


@dataclass(frozen=True)
class SourceTraits:
    """How the poller treats a source; its module's spec says (sidecar.host.sources.spec)."""

    # Polled this often whatever --poll-interval says (a notice minutes long); None:
    # every --poll-interval.
    poll_interval_seconds: Optional[float] = None
    # A release known long ahead: polled on the adaptive schedule (sidecar.host.schedule).
    adaptive: bool = False
    # Calls the account's OpenAPI: counted against --max-api-rate and held to the least
    # --poll-interval for the cloud's API.
    api_budget: bool = False
    # Adds to another source on the same machine: under --source auto a refusal
    # (SourceRefused) skips it with the reason instead of degrading the daemon.
    optional: bool = False
