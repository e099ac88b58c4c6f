"""A save, recorded: what it teaches the rule, whom it tells, and what follows it.

Standard library only. The guard's ``saving()`` and ``record_save()`` end here. A save is
taken to be for the decision the last ``should_save()`` made (``asked``): its budget is
the cover the save gives, its kind (routine, fallback, final, top-up, a drill's) names it
in the job events, and the rule's own save is followed until durable
(``sidecar.train.durability``) and reported to a drill (``sidecar.train.drill``).
"""

from __future__ import annotations

from typing import Callable, Optional

from sidecar.train.decision_notes import DecisionNotes
from sidecar.train.drill import DrillFollower
from sidecar.train.durability import DurabilityFollower
from sidecar.train.job_events import JobEvents, save_kind
from sidecar.train.policy import PolicyDecision, SavePolicy
from sidecar.train.routine import RoutineSaves
from sidecar.train.step_time import LoopTimer

__all__ = ["SaveRecorder"]


class SaveRecorder:
    """Records each save for the guard, against the decision that asked for it."""

    def __init__(self, policy: SavePolicy, *, routine: RoutineSaves, notes: DecisionNotes,
                 loop: LoopTimer, events: JobEvents, durability: DurabilityFollower,
                 drill: DrillFollower, clock: Callable[[], float]) -> None:
        self._policy = policy
        self._routine = routine
        self._notes = notes
        self._loop = loop
        self._events = events
        self._durability = durability
        self._drill = drill
        self._clock = clock
        self.asked: Optional[PolicyDecision] = None  # should_save()'s last decision
        self._asked_unix: Optional[float] = None  # when should_save() decided it

    def asking(self, decision: PolicyDecision, now_unix: float) -> None:
        """``should_save()`` decided at ``now_unix``: the next save is for this decision."""
        self.asked = decision
        self._asked_unix = now_unix

    def started(self, step: Optional[int], *, started_unix: float,
                deadline_unix: Optional[float]) -> None:
        """A save timed by the guard (``saving()``) starts: the ``save-started`` event."""
        asked = self.asked
        self._events.send("save-started", step=step, save=self.kind(asked),
                          budget_seconds=None if asked is None else asked.budget_seconds,
                          remaining_seconds=None if deadline_unix is None
                          else deadline_unix - started_unix)

    def record(self, seconds: float, *, started_unix: float,
               deadline_unix: Optional[float], step: Optional[int] = None,
               committed: Optional[Callable[[], bool]] = None) -> None:
        """A save finished: taught to the rule, told to the job's daemon, followed."""
        # The budget of the asking decision (the save covers what it promised); the
        # deadline known when it started (a routine save made before the deadline was
        # known, or while it was far, is not the final save: SavePolicy.record_save).
        asked = self.asked
        budget = None if asked is None else asked.budget_seconds
        self._routine.saved(started_unix)  # any save restarts the routine interval
        # The rule's own save (a routine or fallback save is for no deadline).
        rule = None if asked is None or asked.routine or asked.fallback else asked
        if rule is not None and rule.save_now and self._asked_unix is not None:
            # It started no earlier than it was asked: a caller's wider timing must not
            # shrink its cover below the deadline the asking decision saw.
            started_unix = max(started_unix, self._asked_unix)
        self._policy.record_save(
            seconds, started_unix=started_unix, deadline_unix=deadline_unix,
            budget_seconds=budget, fallback=asked is not None and asked.fallback,
            margin_seconds=None if asked is None else asked.margin_seconds,
        )
        self._notes.saved(step, started_unix)
        self._loop.pause(seconds)  # a save is not a step
        self._events.send("save-finished", step=step, seconds=seconds,
                          save=self.kind(asked),
                          asynchronous=True if committed is not None else None,
                          remaining_seconds=None if deadline_unix is None
                          else deadline_unix - self._clock())
        if rule is not None and rule.save_now:  # the save the rule asked for
            self._durability.saved(step=step, deadline_unix=deadline_unix,
                                   top_up=rule.top_up, committed=committed,
                                   drill=self._drill.drilling)
        self._drill.saved(seconds=seconds, started_unix=started_unix, step=step, asked=rule)

    def kind(self, asked: Optional[PolicyDecision]) -> str:
        """The save's name in the events: a drill's own save is a ``drill`` save, never
        the release's ``final`` (docs/events.md)."""
        kind = save_kind(asked)
        return "drill" if kind in ("final", "top-up") and self._drill.drilling else kind
