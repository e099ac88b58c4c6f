"""A fire drill on the guard's side: the drill's deadline, followed like a release for the
save and never for the stop, and the report of what happened.

Standard library only. The daemon serves a drill as ``/v1/expiry``'s ``drill`` object
(docs/drill.md). While this rank follows one, its deadline is the earlier of the drill's
and the real one, and the vote carries the drill's too (``Vote.drill_seconds``), so every
rank tells a drill from a release alike: the decision is a drill's when the earliest
deadline of any rank is a drill's. The save is the real one (the real budget, the user's
save function, the upload followed until durable); then training goes on in the same
process: ``should_stop()`` never stops for a drill. A rank is done with a drill when its
checkpoint is durable, when the lead could not hold a save (none is started), or when the
drill's deadline passes; it then reports once (a ``"drill"`` job event with the figures)
and ignores that drill from then on. "durable" means durable by the drill deadline: a
checkpoint durable only after it is reported "not-durable" (a release would have lost it).
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import Callable, Optional

from sidecar.train.deadline import DeadlineTracker
from sidecar.train.deadlines import DRILL, Candidate, earliest
from sidecar.train.durability import DurabilityFollower
from sidecar.train.job_events import JobEvents
from sidecar.train.policy import PolicyDecision
from sidecar.train.vote import Vote

__all__ = ["DrillFollower"]

# The guard's own voice: these lines are the guard's, as users filter them.
logger = logging.getLogger("sidecar.train.guard")

# A drill's remaining time and the earliest remaining time, both reduced across ranks,
# come from clocks read microseconds apart: the same deadline within this.
SAME_DEADLINE_SECONDS = 0.5
_DONE_KEPT = 16  # drill ids remembered as done


@dataclass
class _DrillSave:
    """The save made for the drill: when it started, how long it blocked, its step."""

    started_unix: float
    seconds: float
    step: Optional[int]
    budget_seconds: Optional[float]


class DrillFollower:
    """The drill this rank follows, if any; ``enabled=False`` (no daemon drills through a
    seven-float reducer) follows none."""

    def __init__(self, tracker: DeadlineTracker, durability: DurabilityFollower,
                 events: JobEvents, clock: Callable[[], float], enabled: bool) -> None:
        self._tracker = tracker
        self._durability = durability
        self._events = events
        self._clock = clock
        self._enabled = enabled
        self._id: Optional[str] = None
        self._deadline: Optional[float] = None
        self._save: Optional[_DrillSave] = None
        self._budget: Optional[float] = None
        self._done: deque[str] = deque(maxlen=_DONE_KEPT)
        #: The last collective decision was made for a drill's deadline.
        self.drilling = False

    def deadline(self, now_unix: float) -> Optional[float]:
        """The drill deadline this rank follows now, None when none is (no drill, done
        with it, or its deadline passed: then it reports)."""
        drill = self._tracker.drill if self._enabled else None
        if drill is None:
            # The daemon serves a drill only until its deadline: one this rank saved for
            # (a save that ran past it) is still judged and reported.
            if self._save is not None and self._deadline is not None and (
                now_unix >= self._deadline
            ):
                self._deadline_passed()
            return None
        identity = str(drill.get("id"))
        deadline = float(drill["expires_at_unix"])  # type: ignore[arg-type]  # checked: models
        if identity in self._done:
            return None
        if identity != self._id:
            self._id, self._deadline, self._save, self._budget = identity, deadline, None, None
            logger.info("fire drill %s: a drill deadline in %.0f s; the save is real, then "
                        "training goes on", identity, deadline - now_unix)
        if now_unix >= deadline:
            self._deadline_passed()
            return None
        return deadline

    def earlier(self, real: Optional[Candidate], now_unix: float,
                ) -> tuple[Optional[Candidate], Optional[float]]:
        """(the deadline to decide on, the drill's or None): the drill's (source and kind
        ``"drill"``), unless the ``real`` deadline is as early
        (``sidecar.train.deadlines.earliest``)."""
        drill = self.deadline(now_unix)
        return earliest([real, None if drill is None else Candidate(drill, DRILL, DRILL)]), drill

    def holds(self) -> bool:
        """Whether the last decision was a drill's (then never stop for it): follows its
        checkpoint on the way."""
        if self.drilling:
            self._durability.follow()
            self.follow()
        return self.drilling

    def decided(self, vote: Vote, decision: PolicyDecision, *, agreed: bool) -> None:
        """After each decision the loop acts on (``agreed``; not status()'s): whether it
        was a drill's; a drill whose lead cannot hold a save ends here, with none started."""
        if not agreed:
            return
        drill, remaining = vote.drill_seconds, vote.remaining_seconds
        self.drilling = drill is not None and remaining is not None and (
            drill <= remaining + SAME_DEADLINE_SECONDS)
        if not self.drilling or self._id is None or self._id in self._done:
            return
        if decision.save_now and not (decision.top_up or decision.routine):
            self._budget = decision.budget_seconds
        if decision.too_late:
            self._finish("too-late", reason=decision.reason, budget=decision.budget_seconds,
                         remaining=decision.remaining_seconds)

    def saved(self, *, seconds: float, started_unix: float, step: Optional[int],
              asked: Optional[PolicyDecision]) -> None:
        """A save finished: the drill's when the rule asked for it as the drill's final."""
        if (self.drilling and self._id is not None and self._id not in self._done
                and self._save is None and asked is not None and asked.save_now
                and not asked.top_up):
            self._save = _DrillSave(started_unix, seconds, step, asked.budget_seconds)

    def follow(self) -> None:
        """After the durability follower: report once the drill's checkpoint is durable."""
        if self._save is None or self._id is None or self._id in self._done:
            return
        final = self._durability.final
        if final.durable_unix is not None and final.step == self._save.step:
            self._durable(final.durable_unix)

    def _deadline_passed(self) -> None:
        if self._id is None or self._id in self._done:
            return
        self._durability.follow()
        final = self._durability.final
        if self._save is not None and final.durable_unix is not None and (
            final.step == self._save.step
        ):
            self._durable(final.durable_unix)
        elif self._save is not None:
            self._finish("not-durable", reason=f"upload {self._tracker.upload_status or 'none'}")
        else:
            self._finish("no-save", reason="no save was asked for before the drill deadline")

    def _durable(self, durable_unix: float) -> None:
        """The drill's checkpoint is durable: a drill passes only when it was durable by
        the drill deadline; later is "not-durable", as a release would have found it."""
        assert self._deadline is not None
        late = durable_unix - self._deadline
        if late > 0:
            self._finish("not-durable", durable_unix=durable_unix,
                         reason=f"durable {late:.1f} s after the drill deadline")
        else:
            self._finish("durable", durable_unix=durable_unix)

    def _finish(self, outcome: str, *, reason: Optional[str] = None,
                durable_unix: Optional[float] = None, budget: Optional[float] = None,
                remaining: Optional[float] = None) -> None:
        assert self._id is not None and self._deadline is not None
        identity, deadline, save = self._id, self._deadline, self._save
        self._done.append(identity)
        figures: dict[str, object] = {"id": identity, "outcome": outcome,
                                      "budget_seconds": budget if save is None
                                      else save.budget_seconds or self._budget,
                                      "remaining_seconds": remaining}
        if save is not None:
            figures["save_seconds"] = save.seconds
            figures["remaining_seconds"] = deadline - save.started_unix
            if durable_unix is not None:
                figures["upload_seconds"] = max(0.0, durable_unix - save.started_unix
                                                - save.seconds)
                figures["durable_seconds"] = durable_unix - save.started_unix
                figures["lead_seconds"] = deadline - durable_unix
        report = {k: v for k, v in figures.items() if v is not None}
        self._events.send("drill", step=None if save is None else save.step, reason=reason,
                          drill=report)
        if outcome == "durable":
            logger.info("fire drill %s: checkpoint (step %s) durable %.1f s before the drill "
                        "deadline (save %.1f s, then %.1f s to durable); training goes on",
                        identity, None if save is None else save.step,
                        report["lead_seconds"], report["save_seconds"],
                        report["upload_seconds"])
        else:
            logger.warning("fire drill %s: %s%s; training goes on", identity, outcome,
                           f" ({reason})" if reason else "")
        self._durability.forget()  # the next real release is followed afresh
