"""The save policy: the rule's measurements and phase, pure (clock injected, no I/O).

The decision is the table in ``sidecar.train.rule`` (docs/save-rule.md). This module keeps
what it reads: the recent steps (the step estimate, a statistic over a sliding window, so
a slow warm-up step is forgotten), the recent saves (the save estimate: measured once a
save was, else ``save_seconds``), the cover of the saves made for a deadline (one final
save per deadline: it covers every deadline up to one budget after it started, and a
deadline that moves later than that by more than the margin re-arms the rule), the work
at risk since the last save, and the :class:`~sidecar.train.rule.Phase` (ARMED,
FINAL_SAVED(n), TOPPED_UP). Only ``record_*`` (and :meth:`SavePolicy.forget_cover`)
write; :meth:`SavePolicy.decide`, :meth:`SavePolicy.evaluate` and the estimates never do.

The seed rule (verl's ``should_save_ckpt_esi``) is kept, by name, in :func:`seed_rule`
and :func:`verl_rule`. Decided and left as they are (docs/simulation.md): a save never
measured is assumed to take ``save_seconds`` (60 s); a spike rarer than the ``window``
of steps is forgotten like a warm-up step.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from sidecar.train import rule
from sidecar.train.estimates import AUTO, STATISTICS, margin_for, quantile
from sidecar.train.policy_decision import PolicyDecision
from sidecar.train.routine import check_routine
from sidecar.train.rule import REARM_FLOOR_SECONDS, DeadlineKind, Phase, Situation
from sidecar.train.seed_rule import (
    DEFAULT_REDUNDANT_SECONDS,
    DEFAULT_SAVE_SECONDS,
    check_seconds,
    seed_rule,
    verl_rule,
)

__all__ = [
    "DEFAULT_REDUNDANT_SECONDS",
    "DEFAULT_SAVE_SECONDS",
    "DEFAULT_TOP_UP_SECONDS",
    "LATE_SAVES_AUTO",
    "LATE_SAVES_EXPECTED",
    "REARM_FLOOR_SECONDS",
    "STATISTICS",
    "PolicyDecision",
    "SavePolicy",
    "check_seconds",
    "quantile",
    "seed_rule",
    "verl_rule",
]

# The margin a top-up save keeps before the release, on top of the x1.2 on measured saves
# and uploads. Chosen on the simulator (docs/simulation.md, "Choosing the top-up margin"):
# the largest margin that keeps the median loss within the oracle's + one step + 10 % on
# the reference workloads where a top-up fits at all, with no miss; a top-up cut by the
# release only loses the steps trained after the final save.
DEFAULT_TOP_UP_SECONDS = 5.0

LATE_SAVES_EXPECTED = "expected"  # try_late_saves: when the unpadded time still fits
LATE_SAVES_AUTO = "auto"  # (default) "expected" for the machine's end, False for others


def _check_count(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return value


@dataclass
class SavePolicy:
    """When to save before the deadline, and when to stop.

    Arguments (all seconds unless said otherwise):

    - ``save_seconds``: the save time assumed until a save was measured (default 60).
    - ``redundant_seconds``: safety margin for clock error, late notices and the
      release itself (default 120), or "auto": the one that loses least from the measured
      spread (``sidecar.train.margin``; docs/simulation.md, "Choosing the margin").
    - ``window``: how many recent steps the step estimate looks at (default 100).
    - ``statistic``: "max" (default), "p95" or "p99" over that window. "max" is the safe
      choice; a percentile ignores rare outliers (an evaluation step, a GC pause) at
      the risk of being one slow step short.
    - ``save_margin``: factor (>= 1) applied to the largest recent measured save.
    - ``save_window``: how many recent measured saves count (default 5).
    - ``top_up_seconds``: the margin a top-up save keeps before the release (default
      5); None: no top-up, stop right after the final save.
    - ``try_late_saves``: start the save even when less time is left than its padded
      estimate: True always, False never, "expected" when the unpadded time fits, "auto"
      (default) as "expected" for the machine's end and as False for the process's (a
      SIGTERM grace, a Slurm limit: a clean exit first). docs/simulation.md, "Late saves".
    - ``routine_seconds``: routine saves (``sidecar.train.routine``). "auto" (default):
      only while a running source's notice (or the SIGTERM grace) is shorter than step +
      save + upload, every sqrt(2 x save x mean time between reclaims); a number: every
      that many seconds; None: never. Any save restarts the interval.
    - ``fallback_saves``: True (default): one save before the final one when that rests
      on an upload longer than the margin (``sidecar.train.fallback``); False: none.

    The rows they move: docs/save-rule.md. Invalid values raise ``ValueError`` naming the
    argument: failing at construction beats a wrong decision hours later.
    """

    save_seconds: float = DEFAULT_SAVE_SECONDS
    redundant_seconds: Union[float, str] = DEFAULT_REDUNDANT_SECONDS
    window: int = 100
    statistic: str = "max"
    save_margin: float = 1.2
    save_window: int = 5
    top_up_seconds: Optional[float] = DEFAULT_TOP_UP_SECONDS
    try_late_saves: Union[bool, str] = LATE_SAVES_AUTO
    routine_seconds: Union[str, float, None] = "auto"
    fallback_saves: bool = True

    _steps: deque[float] = field(init=False, repr=False)
    _saves: deque[float] = field(init=False, repr=False)
    _cover_until_unix: Optional[float] = field(default=None, init=False, repr=False)
    # The cover of the last save of any kind, until the next step (nothing unsaved).
    _fresh_cover_until_unix: Optional[float] = field(default=None, init=False, repr=False)
    _phase: Phase = field(default=rule.ARMED, init=False, repr=False)
    # Training since the last save ("auto": what a cut save loses).
    _at_risk_seconds: float = field(default=0.0, init=False, repr=False)

    def __post_init__(self) -> None:
        self.save_seconds = check_seconds("save_seconds", self.save_seconds)
        if self.redundant_seconds != AUTO:
            self.redundant_seconds = check_seconds("redundant_seconds", self.redundant_seconds)
        if self.try_late_saves not in (True, False, LATE_SAVES_EXPECTED, LATE_SAVES_AUTO):
            raise ValueError("try_late_saves: True, False, 'expected' or 'auto': "
                             f"{self.try_late_saves!r}")
        self.window = _check_count("window", self.window)
        self.save_window = _check_count("save_window", self.save_window)
        if self.statistic not in STATISTICS:
            raise ValueError(f"statistic must be one of {', '.join(STATISTICS)}, "
                             f"got {self.statistic!r}")
        margin = check_seconds("save_margin", self.save_margin)
        if margin < 1.0:
            raise ValueError(f"save_margin must be >= 1 (a factor), got {self.save_margin!r}")
        self.save_margin = margin
        if self.top_up_seconds is not None:
            self.top_up_seconds = check_seconds("top_up_seconds", self.top_up_seconds)
        self.routine_seconds = check_routine(self.routine_seconds)
        if not isinstance(self.fallback_saves, bool):
            raise ValueError(f"fallback_saves must be True or False, got {self.fallback_saves!r}")
        self._steps = deque(maxlen=self.window)
        self._saves = deque(maxlen=self.save_window)


    def record_step(self, seconds: float) -> None:
        """Add one measured training step: one pass of the loop between two decisions
        (data loading included), not counting saves.

        Also ends the cover that the last save had only for having nothing unsaved after
        it (see :meth:`record_save`).
        """
        self._steps.append(check_seconds("seconds", seconds))
        self._at_risk_seconds += seconds
        self._fresh_cover_until_unix = None
        if self._phase.stage is rule.Stage.FINAL_SAVED:
            self._phase = rule.final_saved(self._phase.steps + 1)

    def record_save(
        self,
        seconds: float,
        *,
        started_unix: float,
        deadline_unix: Optional[float],
        budget_seconds: Optional[float] = None,
        fallback: bool = False,
        margin_seconds: Optional[float] = None,
    ) -> None:
        """Add one measured save that started at ``started_unix`` (wall clock).

        ``deadline_unix``: the deadline known when the save started (None if none), the
        one the guard's asking decision used; required, so no caller silently gets the
        wrong cover. Every save is measured. It is the *final* save, and covers deadlines
        up to ``started_unix + budget``, only when it was made for the known deadline
        (``deadline_unix <= started_unix + budget``, the rule's own window); a save made
        with none known, or with it outside the window (a routine save), covers only until
        the next :meth:`record_step` (nothing unsaved since), so a deadline learned later
        gets its own save (found by the simulator: ``sidecar+periodic-30``). The budget is
        the largest of ``budget_seconds`` (the asking decision's), the budget before and
        after this measurement: a faster save than assumed never shrinks the cover below
        the decision that asked for it (which would re-arm at once and save twice).

        ``fallback``: the fallback save (``sidecar.train.fallback``): measured and resets
        the work at risk, but covers nothing. ``margin_seconds``: the margin the asking
        decision kept (:attr:`PolicyDecision.margin_seconds`, the guard passes it); None:
        the one this policy keeps now (:meth:`margin_for`, no upload).
        """
        seconds = check_seconds("seconds", seconds)
        if not math.isfinite(started_unix):
            raise ValueError(f"started_unix must be finite, got {started_unix!r}")
        if deadline_unix is not None and not math.isfinite(deadline_unix):
            raise ValueError(f"deadline_unix must be finite or None, got {deadline_unix!r}")
        step = self.step_estimate()
        margin = (self.margin_for(step, self.save_estimate(), None) if margin_seconds is None
                  else check_seconds("margin_seconds", margin_seconds))
        rearm = max(margin, REARM_FLOOR_SECONDS)
        before = (step or 0.0) + self.save_estimate() + margin
        self._saves.append(seconds)
        self._at_risk_seconds = 0.0
        after = (step or 0.0) + self.save_estimate() + margin
        budget = max(before, after, budget_seconds or 0.0)
        cover = started_unix + budget
        if fallback:
            return
        self._fresh_cover_until_unix = cover
        if deadline_unix is None or deadline_unix > cover:
            return  # a routine save: not made for any deadline
        if self._cover_until_unix is None or (
            deadline_unix > self._cover_until_unix + rearm
        ):
            self._phase = rule.final_saved(0)  # the final save: a top-up may follow
        elif self._phase.steps_after_final() > 0:
            self._phase = rule.TOPPED_UP  # a save after training past the final save
        # A later save never shrinks what an earlier one covers.
        if self._cover_until_unix is None or cover > self._cover_until_unix:
            self._cover_until_unix = cover


    def state_dict(self) -> dict[str, list[float]]:
        """The measurements (recent steps and saves), plain JSON: put it in the
        checkpoint so that a resumed job decides with what it learned, not with guesses."""
        return {"steps": list(self._steps), "saves": list(self._saves)}

    def load_state_dict(self, state: Mapping[str, object]) -> None:
        """Seed the windows from :meth:`state_dict`. ValueError naming the field on bad
        data, before anything is changed (:meth:`CheckpointGuard.load_state_dict` turns
        that into a warning: a resume never fails for it)."""
        loaded = {}
        for name in ("steps", "saves"):
            values = state.get(name, [])
            if not isinstance(values, (list, tuple)):
                raise ValueError(f"{name} must be a list of seconds, got {values!r}")
            loaded[name] = [check_seconds(name, value) for value in values]
        self._steps.extend(loaded["steps"])
        self._saves.extend(loaded["saves"])


    def step_estimate(self) -> Optional[float]:
        """``T_max_step``: the chosen statistic over the window; None before any step."""
        if not self._steps:
            return None
        return quantile(list(self._steps), STATISTICS[self.statistic])

    def typical_step_estimate(self) -> Optional[float]:
        """The median step of the window (None before any step): what the top-up save
        bets the next step takes (a top-up cut by a rare slow step leaves the final one)."""
        if not self._steps:
            return None
        return quantile(list(self._steps), 0.5)

    def measured_save_estimate(self) -> Optional[float]:
        """The largest of the recent measured saves times ``save_margin``; None if none."""
        if not self._saves:
            return None
        return max(self._saves) * self.save_margin

    def save_estimate(self) -> float:
        """``T_save``: the configured value until a save was measured, then measured only
        (in both directions: a too-large guess kept as a floor would start the final save
        early for nothing; the x ``save_margin`` and the window's max cover variation)."""
        measured = self.measured_save_estimate()
        return self.save_seconds if measured is None else measured

    def covered_seconds(self, now_unix: float) -> Optional[float]:
        """How far beyond ``now_unix`` the saves made for a deadline cover (negative: it
        ended; None: none). Routine saves count until the next step only. The guard
        reduces it across ranks (the largest wins: any rank's save covers everyone)."""
        covers = [c for c in (self._cover_until_unix, self._fresh_cover_until_unix)
                  if c is not None]
        if not covers:
            return None
        return max(covers) - now_unix

    def forget_cover(self) -> None:
        """The deadline moved beyond the saves' cover (a renewal: the guard calls this on
        the decision that says so, :attr:`PolicyDecision.rearmed`). A deadline that later
        comes back within that cover (a SIGTERM soon after a renewal) finds work no save
        holds and gets its own save (found on a real Slurm job, ``scontrol update
        TimeLimit=+5`` then a preemption)."""
        self._cover_until_unix = None
        self._fresh_cover_until_unix = None
        self._phase = rule.ARMED

    def at_risk_seconds(self) -> float:
        """Training since the last save of any kind (0 before a step). Exposed so that the
        guard can reduce it across ranks with MIN (the ranks that recorded the save win,
        as for :meth:`steps_after_final`)."""
        return self._at_risk_seconds

    def steps_after_final(self) -> float:
        """Steps trained since the final save, -1 once the top-up save after it was made,
        ``inf`` before any final save. Exposed so that the guard can reduce it across
        ranks with MIN (the ranks that recorded the saves win; in a job where only rank 0
        writes checkpoints the others learn of them this way)."""
        return self._phase.steps_after_final()

    @property
    def phase(self) -> Phase:
        """ARMED, FINAL_SAVED(n) or TOPPED_UP (:class:`sidecar.train.rule.Phase`)."""
        return self._phase

    def rearm_after_seconds(self, margin_seconds: Optional[float] = None) -> float:
        """How far past the final save's cover a deadline must move to re-arm the rule:
        the margin (``margin_seconds``, else the one this policy keeps now), at least
        :data:`REARM_FLOOR_SECONDS` (issue 13: a deadline moved later by less is noise the
        final save budgeted for; a renewal moves it by hours)."""
        if margin_seconds is None:
            margin_seconds = self.margin_for(self.step_estimate(), self.save_estimate(), None)
        return max(margin_seconds, REARM_FLOOR_SECONDS)

    def margin_for(self, step_seconds: Optional[float], durable_save: float,
                   upload_seconds: Optional[float]) -> float:
        """The margin to keep now (:func:`sidecar.train.estimates.margin_for`)."""
        return margin_for(
            self.redundant_seconds, steps=list(self._steps), saves=list(self._saves),
            step_seconds=step_seconds, durable_save=durable_save,
            upload_seconds=upload_seconds, at_risk_seconds=self._at_risk_seconds)


    def evaluate(
        self,
        now_unix: float,
        deadline_unix: Optional[float],
        upload_seconds: Optional[float] = None,
    ) -> PolicyDecision:
        """Decide from this process's own measurements and an absolute deadline."""
        remaining = None if deadline_unix is None else deadline_unix - now_unix
        return self.decide(
            remaining,
            step_seconds=self.step_estimate(),
            save_seconds=self.save_estimate(),
            covered_seconds=self.covered_seconds(now_unix),
            upload_seconds=upload_seconds,
            typical_step_seconds=self.typical_step_estimate(),
        )

    def situation(
        self,
        remaining_seconds: Optional[float],
        *,
        step_seconds: Optional[float],
        save_seconds: float,
        covered_seconds: Optional[float],
        upload_seconds: Optional[float] = None,
        steps_after_final: Optional[float] = None,
        typical_step_seconds: Optional[float] = None,
        margin_seconds: Optional[float] = None,
        at_risk_seconds: Optional[float] = None,
        machine_deadline: Optional[bool] = None,
        kind: Optional[DeadlineKind] = None,
        collective: bool = False,
        sigterm: bool = False,
        routine_overdue_seconds: Optional[float] = None,
    ) -> Situation:
        """What the rule reads, gathered once (the arguments of :meth:`decide`)."""
        if margin_seconds is None:
            # Across ranks the fixed margin ("auto" is per process: ranks measure apart).
            margin_seconds = self.margin_for(
                None if collective else step_seconds,
                0.0 if collective else save_seconds + (upload_seconds or 0.0),
                None if collective else upload_seconds)
        if kind is None:
            kind = (DeadlineKind.UNKNOWN if machine_deadline is None else
                    DeadlineKind.MACHINE if machine_deadline else DeadlineKind.PROCESS)
        return Situation(
            remaining_seconds=remaining_seconds,
            step_seconds=step_seconds,
            typical_step_seconds=step_seconds if typical_step_seconds is None
            else typical_step_seconds,
            save_seconds=save_seconds,
            upload_seconds=upload_seconds,
            margin_seconds=margin_seconds,
            covered_seconds=covered_seconds,
            phase=self._phase if steps_after_final is None
            else Phase.of_steps_after_final(steps_after_final),
            at_risk_seconds=self._at_risk_seconds if at_risk_seconds is None
            else at_risk_seconds,
            kind=kind,
            settings=rule.Settings(self.top_up_seconds, self.fallback_saves,
                                   self.try_late_saves, self.save_margin),
            sigterm=sigterm,
            routine_overdue_seconds=routine_overdue_seconds,
        )

    def decide(self, remaining_seconds: Optional[float], **inputs: Any) -> PolicyDecision:
        """The rule (``sidecar.train.rule``, docs/save-rule.md) from explicit inputs, the
        keyword arguments of :meth:`situation` (the guard passes values reduced across
        ranks; None: this policy's own). ``upload_seconds``: from the local save to
        durable (None or 0: the local save is durable); ``machine_deadline`` or ``kind``:
        whose end the deadline is (None: not known); ``collective``: the fixed margin;
        ``sigterm``: a SIGTERM came; ``routine_overdue_seconds`` >= 0: a routine save is
        due. Writes nothing."""
        situation = self.situation(remaining_seconds, **inputs)
        return PolicyDecision.of(rule.decide(situation), situation)
