"""The time one pass of the training loop takes: what the save rule's step window holds.

Standard library only. The rule budgets ``T_max_step`` for the wait until the next
decision, so a step is timed from the end of the previous one: data loading, logging, the
decisions themselves (a daemon request, a collective vote) and anything else outside the
``with guard.step():`` span count. Only the span was timed before; with steps of a few
milliseconds on a loaded machine the loop took several times what was measured, and the
top-up save, which bets on one more typical step, was skipped (issue 26, item 7). Saves
and the wait for the release are not training and are left out.
"""

from __future__ import annotations

from typing import Callable, Optional

__all__ = ["LoopTimer"]


class LoopTimer:
    """Times passes of the loop between the ends of successive ``guard.step()`` spans."""

    def __init__(self, monotonic: Callable[[], float]) -> None:
        self._monotonic = monotonic
        self._pass_started: Optional[float] = None  # the previous step's end
        self._paused = 0.0  # saves and release waits since then

    def step_done(self, span_started: float) -> float:
        """The pass that ends now, whose step span began at ``span_started``: the time
        since the previous step ended, less the pauses, and never less than the span (the
        first step, or one after a pause reported longer than it lasted)."""
        now = self._monotonic()
        span = max(0.0, now - span_started)
        seconds = span
        if self._pass_started is not None:
            seconds = max(span, now - self._pass_started - self._paused)
        self._pass_started, self._paused = now, 0.0
        return seconds

    def pause(self, seconds: float) -> None:
        """``seconds`` of this pass were not training (a save, the wait for the release)."""
        self._paused += max(0.0, seconds)
