"""Follows the final and the top-up checkpoint until each is durable, and says when (or
says loudly that the release came first).

Standard library only. Durable means committed (an asynchronous save's ``committed()``
returned True) and, with the daemon's uploader, uploaded (``SidecarClient.is_durable``);
without an uploader the local save counts. Asked from the training thread, at most once
per ``refresh_seconds``; never raises into the training loop.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Callable, Optional

from sidecar.train.deadline import DeadlineTracker
from sidecar.train.job_events import JobEvents

__all__ = ["DurabilityFollower", "FollowedSave"]

# The guard's own voice: these lines are the guard's, as users filter them.
logger = logging.getLogger("sidecar.train.guard")


@dataclass
class FollowedSave:
    """The final checkpoint, followed until it is durable (or the release comes first)."""

    step: Optional[int] = None
    deadline_unix: Optional[float] = None
    saved_unix: Optional[float] = None
    durable_unix: Optional[float] = None
    next_check: float = -math.inf  # monotonic
    reported: bool = False
    top_up: bool = False
    #: Saved for a fire drill's deadline (sidecar/train/drill.py), not a release's.
    drill: bool = False
    # An asynchronous save: it counts once committed() is True (committed_unix).
    committed: Optional[Callable[[], bool]] = None
    committed_unix: Optional[float] = None

    @property
    def name(self) -> str:
        return "top-up" if self.top_up else "final"

    @property
    def kind(self) -> str:
        """Its ``save`` in the job events: a drill's save is a ``drill`` save."""
        return "drill" if self.drill else self.name

    @property
    def said(self) -> str:
        """The save as the log names it: a drill's is a drill's."""
        return f"{'drill ' if self.drill else ''}{self.name} checkpoint"

    @property
    def until(self) -> str:
        """What the save had to be durable before."""
        return "the drill deadline" if self.drill else "the release"


class DurabilityFollower:
    """The final and the top-up save the rule asked for, each followed to durable."""

    def __init__(
        self,
        tracker: DeadlineTracker,
        events: JobEvents,
        *,
        clock: Callable[[], float],
        monotonic: Callable[[], float],
    ) -> None:
        self._tracker = tracker
        self._events = events
        self._clock = clock
        self._monotonic = monotonic
        self.final = FollowedSave()
        self.top_up = FollowedSave()

    def saved(
        self,
        *,
        step: Optional[int],
        deadline_unix: Optional[float],
        top_up: bool,
        committed: Optional[Callable[[], bool]],
        drill: bool = False,
    ) -> None:
        """The rule's save was made: follow it from now on (a new final save forgets the
        top-up of the one before). ``drill``: made for a fire drill's deadline."""
        now = self._clock()
        uploads = self._tracker.upload_status is not None
        saved = FollowedSave(step=step, deadline_unix=deadline_unix, saved_unix=now,
                             durable_unix=None if uploads or committed else now,
                             top_up=top_up, committed=committed, drill=drill)
        if top_up:
            self.top_up = saved
        else:
            self.final, self.top_up = saved, FollowedSave()
        if uploads and step is None:
            logger.warning("the %s was saved without a step number "
                           "(guard.saving(step=N)): its upload cannot be followed",
                           saved.said)

    def forget(self) -> None:
        """The release they were saved for did not come: the next final save is followed,
        and no "NOT durable before the release" is said for a release that did not happen."""
        self.final = FollowedSave()
        self.top_up = FollowedSave()

    def follow(self) -> None:
        """Ask, at most once per refresh, whether the final (and top-up) checkpoint is
        durable yet; say so once, or say loudly that the release came first. Never raises."""
        self._follow(self.final)
        self._follow(self.top_up)

    def _follow(self, final: FollowedSave) -> None:
        if final.saved_unix is None or final.reported:
            return
        now = self._clock()
        lead = None if final.deadline_unix is None else final.deadline_unix - now
        if final.durable_unix is None and self._monotonic() >= final.next_check:
            final.next_check = self._monotonic() + self._tracker.refresh_seconds
            self._check(final, now)
        if final.durable_unix is not None:
            final.reported = True
            self._say_durable(final)
        elif lead is not None and lead <= 0:
            final.reported = True
            self._say_not_durable(final)

    def _check(self, final: FollowedSave, now: float) -> None:
        uploads = self._tracker.upload_status is not None
        if final.committed is not None and final.committed_unix is None:
            try:
                done = bool(final.committed())
            except Exception:  # the caller's function; never into the training loop
                done = False
            if done:
                final.committed_unix = now
                if not uploads:
                    final.durable_unix = now
        if final.durable_unix is None and final.step is not None and (
            final.committed is None or final.committed_unix is not None
        ):
            try:
                durable = self._tracker.client.is_durable(final.step)
            except Exception:  # a client given by the caller may raise
                durable = None
            if durable:
                final.durable_unix = now

    def _say_durable(self, final: FollowedSave) -> None:
        assert final.durable_unix is not None
        self._events.send("durable", step=final.step, save=final.kind,
                          lead_seconds=None if final.deadline_unix is None
                          else final.deadline_unix - final.durable_unix)
        local = "" if self._tracker.upload_status else " (no uploader: the local save counts)"
        if final.deadline_unix is None:
            logger.info("%s (step %s) durable%s", final.said, final.step, local)
        else:
            logger.info("%s (step %s) durable %.1f s before %s%s", final.said, final.step,
                        final.deadline_unix - final.durable_unix, final.until, local)

    def _say_not_durable(self, final: FollowedSave) -> None:
        unwritten = final.committed is not None and final.committed_unix is None
        upload = self._tracker.upload_status or "no answer"
        self._events.send("not-durable", step=final.step, save=final.kind, reason=(
            "its asynchronous write had not finished" if unwritten
            else f"the upload had not finished ({upload})") + f" when {final.until} came")
        if final.drill:  # the drill's own report judges it (drill.py); nothing was lost
            logger.warning("%s (step %s) was not durable by the drill deadline: %s",
                           final.said, final.step, "its asynchronous write had not finished"
                           if unwritten else f"the uploader had not finished ({upload})")
        elif unwritten:
            logger.error("%s checkpoint (step %s) was NOT committed before the release: "
                         "its asynchronous write had not finished", final.name, final.step)
        elif final.top_up:  # the final checkpoint before it is the one to resume from
            logger.warning("top-up checkpoint (step %s) was not durable before the "
                           "release (%s); resume picks the final checkpoint (step %s)",
                           final.step, upload, self.final.step)
        else:
            logger.error("final checkpoint (step %s) was NOT durable before the release: "
                         "the uploader had not finished (%s)", final.step, upload)
