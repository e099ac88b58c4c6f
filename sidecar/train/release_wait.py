"""Waits, after the final save, until the release comes or moves later (a renewal).

Standard library only. Nothing else could be saved in time, so ``should_stop()`` waits
here, asking as usual, instead of training steps whose work would be lost. Across ranks
the wait asks the others once per refresh until shortly before the earliest release of
any node, then only watches its own clock, so a node that goes away never leaves the
others inside a collective.
"""

from __future__ import annotations

import logging
from typing import Callable, Optional

from sidecar.train.job_events import JobEvents
from sidecar.train.vote import Verdict

__all__ = ["EXIT_RELEASED", "ReleaseWait"]

# The guard's own voice: these lines are the guard's, as users filter them.
logger = logging.getLogger("sidecar.train.guard")

# The exit status for a job that left its loop because the machine is being released
# (BSD's EX_TEMPFAIL): not a crash; resume on the next machine.
EXIT_RELEASED = 75


class ReleaseWait:
    """One wait for the release; ``collective``: the decisions are votes across ranks."""

    def __init__(
        self,
        events: JobEvents,
        *,
        clock: Callable[[], float],
        sleep: Callable[[float], None],
        collective: bool,
    ) -> None:
        self._events = events
        self._clock = clock
        self._sleep = sleep
        self._collective = collective

    def wait(
        self,
        verdict: Verdict,
        *,
        refresh_seconds: float,
        decide: Callable[[], Verdict],
        follow: Callable[[], None],
    ) -> bool:
        """True once the release time has passed (leave the loop), False when the release
        moved later or was called off (train on). ``verdict``: the stop decision and its
        deadline; ``decide``: the next (collective) decision; ``follow``: between sleeps."""
        decision, deadline = verdict
        interval = max(0.05, refresh_seconds)
        # Collectives stop this long before the earliest release (judged on the reduced
        # remaining time, which every rank sees alike), so no rank is inside one when a
        # node goes away.
        quiet_seconds = 2 * interval + 1.0
        asking = decision.remaining_seconds is not None and (
            not self._collective or decision.remaining_seconds > quiet_seconds
        )
        remaining = decision.remaining_seconds
        if remaining is not None and remaining <= 0:
            logger.info("final checkpoint saved; the release passed %.0f s ago", -remaining)
        else:
            logger.info("final checkpoint saved; waiting for the release%s (training "
                        "resumes if it moves later)", _in(remaining))
        self._events.send("waiting", reason=decision.reason,
                          remaining_seconds=decision.remaining_seconds)
        while True:
            if deadline is None:  # the release was called off
                logger.info("the release was called off: training resumes")
                self._events.send("resumed", reason="the release was called off")
                return False
            remaining = deadline - self._clock()
            if remaining <= 0:
                logger.info("the release time has passed: leaving the training loop "
                            "(exit status %d)", EXIT_RELEASED)
                self._events.send("stop", released=True, reason="the release time has passed")
                return True
            self._sleep(min(interval, remaining))
            follow()
            if not asking:
                continue
            decision, deadline = decide()
            if not decision.stop:
                logger.info("the release moved later (now%s): training resumes",
                            _in(decision.remaining_seconds))
                self._events.send("resumed", reason="the release moved later",
                                  remaining_seconds=decision.remaining_seconds)
                return False
            if self._collective and (
                decision.remaining_seconds is None or decision.remaining_seconds <= quiet_seconds
            ):
                asking = False


def _in(remaining_seconds: Optional[float]) -> str:
    return "" if remaining_seconds is None else f" in {remaining_seconds:.0f} s"
