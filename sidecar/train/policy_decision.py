"""The save rule's decision as the guard, its events and its users read it: flags and
figures (``SavePolicy.decide``'s result), rendered from ``sidecar.train.rule.Decision``."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from sidecar.train import rule
from sidecar.train.rule import Situation, Why

__all__ = ["PolicyDecision"]


@dataclass(frozen=True)
class PolicyDecision:
    """One evaluation of the rule, with the numbers behind it (for logs and status).

    ``remaining_seconds`` is None when no deadline is known; ``budget_seconds`` and
    ``step_seconds`` are None before the first step was measured.
    """

    save_now: bool
    stop: bool
    remaining_seconds: Optional[float]
    budget_seconds: Optional[float]
    step_seconds: Optional[float]
    save_seconds: float
    reason: str
    # The upload after the save that the budget includes (None: no uploader, or unknown).
    upload_seconds: Optional[float] = None
    # The save asked for (or the training allowed) is the top-up after the final save.
    top_up: bool = False
    # Inside the window, but a save (and its upload) would not end before the release:
    # none is started (SavePolicy.try_late_saves).
    too_late: bool = False
    # The deadline already passed with no save made for it: this save is a best effort
    # on borrowed time (it may be cut; the previous checkpoint stays valid).
    best_effort: bool = False
    # The deadline moved beyond what the saves made for it cover (a renewal): the cover is
    # for a deadline that no longer holds; the guard forgets it (SavePolicy.forget_cover).
    rearmed: bool = False
    # A routine save (sidecar.train.routine): no notice holds a save, so the guard asks
    # one at the Young/Daly interval; it is never the final save and disarms nothing.
    routine: bool = False
    # A fallback save (sidecar.train.fallback): made before the final save, when that one
    # rests on an upload longer than the margin; it covers no deadline.
    fallback: bool = False
    # The table's row that decided (sidecar.train.rule.Why), and the margin it kept: what a
    # save it asks for is recorded with (SavePolicy.record_save).
    why: Optional[Why] = field(default=None, compare=False)
    margin_seconds: Optional[float] = field(default=None, compare=False)

    @classmethod
    def of(cls, decision: rule.Decision, situation: Situation) -> PolicyDecision:
        """The rule's decision, as the guard and its users read it."""
        why = decision.why
        return cls(
            save_now=decision.action is rule.Action.SAVE,
            stop=decision.action is rule.Action.STOP,
            remaining_seconds=situation.remaining_seconds,
            budget_seconds=situation.budget_seconds,
            step_seconds=situation.step_seconds,
            save_seconds=situation.save_seconds,
            reason=decision.text,
            upload_seconds=situation.upload_seconds,
            top_up=why in (Why.TOP_UP_TRAIN, Why.TOP_UP_SAVE),
            too_late=why is Why.TOO_LATE,
            best_effort=why is Why.BEST_EFFORT,
            rearmed=decision.rearmed,
            routine=why is Why.ROUTINE,
            fallback=why is Why.FALLBACK,
            why=why,
            margin_seconds=situation.margin_seconds,
        )


