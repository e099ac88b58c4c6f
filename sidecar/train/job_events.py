"""Tells this node's daemon what the job does (``POST /v1/events``), without waiting.

Standard library only. Each event is a queue put on the client (its background thread
sends it), so no step waits for the daemon; a duck-typed client without ``send_event()``
(the simulator's, Ray's ``NodeDeadlines``) sends none. docs/events.md lists the kinds.
"""

from __future__ import annotations

import math
import os
import socket
from typing import Any, Callable, Optional

from sidecar.train.policy import PolicyDecision

__all__ = ["ESTIMATE_EVENT_SECONDS", "JobEvents", "job_id", "rank_from_environment", "save_kind"]

# The step estimate and the budget go out at most this often; saves, the wait and the
# stop each time they happen.
ESTIMATE_EVENT_SECONDS = 30.0


class JobEvents:
    """The job's events for its node's daemon; ``enabled=False`` sends none."""

    def __init__(
        self,
        client: Any,
        *,
        enabled: bool,
        job: Optional[str],
        clock: Callable[[], float],
        monotonic: Callable[[], float],
    ) -> None:
        self._send = getattr(client, "send_event", None) if enabled else None
        self._job = job_id(job)
        self._rank = rank_from_environment()
        self._clock = clock
        self._monotonic = monotonic
        self._next_estimate = -math.inf  # monotonic

    def send(self, kind: str, **fields: object) -> None:
        """Queue one event; never raises, never waits. None and non-finite values are
        left out."""
        send = self._send
        if send is None:
            return
        try:
            event: dict[str, object] = {"kind": kind, "job": self._job, "at_unix": self._clock()}
            if self._rank is not None:
                event["rank"] = self._rank
            for name, value in fields.items():
                finite = not isinstance(value, float) or math.isfinite(value)
                if value is not None and finite:
                    event[name] = value
            send(event)
        except Exception:  # a client given by the caller may raise; events are never worth it
            pass

    def step_estimate(self, decision: PolicyDecision) -> None:
        """The step estimate and the budget, at most once per ESTIMATE_EVENT_SECONDS."""
        if self._send is not None and self._monotonic() >= self._next_estimate:
            self._next_estimate = self._monotonic() + ESTIMATE_EVENT_SECONDS
            self.send("step-estimate", step_seconds=decision.step_seconds,
                      save_seconds=decision.save_seconds,
                      budget_seconds=decision.budget_seconds,
                      remaining_seconds=decision.remaining_seconds)


def save_kind(asked: Optional[PolicyDecision]) -> str:
    """What a save made now is for, as the guard follows it: the decision that asked."""
    if asked is None or not asked.save_now or asked.routine:
        return "routine"
    if asked.fallback:
        return "fallback"
    return "top-up" if asked.top_up else "final"


def job_id(job: Optional[str]) -> str:
    """The job's name in its events: the caller's (checked), else hostname:pid."""
    if job is None:
        name = "".join(c if 33 <= ord(c) <= 126 else "-" for c in socket.gethostname())
        return f"{name[:100] or 'host'}:{os.getpid()}"
    if not isinstance(job, str) or not 0 < len(job) <= 128 or not all(
        33 <= ord(c) <= 126 for c in job
    ):
        raise ValueError(f"job must be 1 to 128 printable ASCII characters without spaces, "
                         f"got {job!r}")
    return job


def rank_from_environment() -> Optional[int]:
    """``$RANK`` (torchrun, Lightning, DeepSpeed set it), when it is a plain number."""
    value = os.environ.get("RANK", "").strip()
    if value.isascii() and value.isdigit() and int(value) <= 1_000_000:
        return int(value)
    return None
