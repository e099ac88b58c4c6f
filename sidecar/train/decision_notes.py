"""Says what the guard's save decisions mean, once each: the save it asks for, a release
no save can meet, and whether the SIGTERM grace holds a save (issue 24, item 2)."""

from __future__ import annotations

import logging
from typing import Optional

from sidecar.train.job_events import JobEvents
from sidecar.train.policy import PolicyDecision
from sidecar.train.protection import DurableCheckpoint, JobFigures, SaidOnce, judge_one
from sidecar.train.sigterm import SigtermDeadline


class DecisionNotes:
    """The log lines and job events of :meth:`CheckpointGuard.should_save`'s decisions."""

    def __init__(self, logger: logging.Logger, events: JobEvents) -> None:
        self._logger = logger
        self._events = events
        self._said_too_late: Optional[float] = None
        self._protection = SaidOnce(logger)  # the SIGTERM grace's verdict, once per change
        self.last_saved: Optional[DurableCheckpoint] = None  # the state it holds, when

    def saved(self, step: Optional[int], started_unix: float) -> None:
        self.last_saved = DurableCheckpoint(step, started_unix)

    def decided(self, decision: PolicyDecision, deadline: Optional[float],
                sigterm: Optional[SigtermDeadline], upload_seconds: Optional[float],
                now_unix: float) -> None:
        if decision.save_now:
            self._logger.log(logging.WARNING if decision.best_effort else logging.INFO,
                             "%s now: %s (row %s)", "top-up checkpoint" if decision.top_up
                             else "checkpoint", decision.reason, _row(decision))
        elif decision.too_late and self._said_too_late != deadline:
            self._said_too_late = deadline  # once per deadline
            self._logger.warning("no checkpoint for this release: %s (row %s)",
                                 decision.reason, _row(decision))
            self._events.send("too-late", reason=decision.reason,
                              remaining_seconds=decision.remaining_seconds)
        self._events.step_estimate(decision)
        if sigterm is not None:  # does the grace hold a save?
            self._protection.say(judge_one(
                "SIGTERM", sigterm.grace_seconds, JobFigures(
                    decision.step_seconds, decision.save_seconds, upload_seconds),
                self.last_saved, now_unix))


def _row(decision: PolicyDecision) -> str:
    """The table's row that decided (docs/save-rule.md), as the log lines name it."""
    return "-" if decision.why is None else decision.why.value
