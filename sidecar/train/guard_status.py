"""What the guard knows right now (:class:`GuardStatus`), assembled from its decision, its
deadline and its collaborators: for a log line or a progress bar (``CheckpointGuard.status``).

Standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from sidecar.train.deadline import DeadlineTracker
from sidecar.train.durability import DurabilityFollower
from sidecar.train.policy import PolicyDecision
from sidecar.train.routine import RoutinePlan

__all__ = ["GuardStatus"]


@dataclass(frozen=True)
class GuardStatus:
    """What the guard knows right now, for a log line or a progress bar."""

    remaining_seconds: Optional[float]
    budget_seconds: Optional[float]
    step_seconds: Optional[float]
    save_seconds: float
    deadline_unix: Optional[float]
    deadline_source: Optional[str]  # "daemon", "env", "slurm", "sigterm" or None
    daemon_reachable: bool
    save_now: bool
    stop: bool
    reason: str
    last_error: Optional[str]
    # Durability (the daemon's checkpoint uploader): how long a save takes to become
    # durable after the local write (None: no uploader or no estimate), its state ("ok",
    # "uploading", "degraded", None without one), the final save's step and when it
    # became durable (a local save is durable at once when no uploader runs).
    upload_seconds: Optional[float] = None
    upload_status: Optional[str] = None
    final_step: Optional[int] = None
    final_durable_at_unix: Optional[float] = None
    # The top-up save after the final one (SavePolicy.top_up_seconds), followed the same way.
    top_up_step: Optional[int] = None
    top_up_durable_at_unix: Optional[float] = None
    # Routine saves (SavePolicy.routine_seconds): their interval now (None: none), and
    # what a reclaim would cost, in a line.
    routine_seconds: Optional[float] = None
    routine_note: Optional[str] = None

    @classmethod
    def of(cls, decision: PolicyDecision, deadline: Optional[float], source: Optional[str],
           tracker: DeadlineTracker, durability: DurabilityFollower,
           last_error: Optional[str], routine: Optional[RoutinePlan] = None) -> GuardStatus:
        """The status of ``decision`` on ``deadline`` (from ``source``)."""
        final, top_up = durability.final, durability.top_up
        return cls(
            remaining_seconds=decision.remaining_seconds,
            budget_seconds=decision.budget_seconds,
            step_seconds=decision.step_seconds,
            save_seconds=decision.save_seconds,
            deadline_unix=deadline,
            deadline_source=source,
            daemon_reachable=tracker.reachable,
            save_now=decision.save_now,
            stop=decision.stop,
            reason=decision.reason,
            last_error=last_error,
            upload_seconds=tracker.upload_seconds,
            upload_status=tracker.upload_status,
            final_step=final.step,
            final_durable_at_unix=final.durable_unix,
            top_up_step=top_up.step,
            top_up_durable_at_unix=top_up.durable_unix,
            routine_seconds=None if routine is None else routine.interval_seconds,
            routine_note=None if routine is None else routine.line,
        )
