"""A frozen copy of the save decision as it was before issue 37 (test-only, not shipped).

``SavePolicy.decide`` of ``sidecar/train/policy.py`` at e745773, with the fallback save's
condition (``sidecar/train/fallback.py``) and the guard's routine overlay (``with_routine``)
copied in, so that tests/train/test_rule_differential.py can run the old decision path
beside the new table (``sidecar.train.rule``). Do not edit it to follow the new code:
it is the reference the new code is proved against.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Callable, Optional, Union

from sidecar.train.estimates import AUTO, margin_for
from sidecar.train.routine import check_routine

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
    "seed_rule",
    "verl_rule",
]

# The ESI guide's defaults: a save is assumed to take 60 s, and 120 s are kept in hand.
DEFAULT_SAVE_SECONDS = 60.0
DEFAULT_REDUNDANT_SECONDS = 120.0

# The margin a top-up save keeps before the release, on top of the x1.2 on measured saves
# and uploads. Chosen on the simulator (docs/simulation.md, "Choosing the top-up margin"):
# the largest margin that keeps the median loss within the oracle's + one step + 10 % on
# the reference workloads where a top-up fits at all, with no miss; a top-up cut by the
# release only loses the steps trained after the final save.
DEFAULT_TOP_UP_SECONDS = 5.0

# The least a deadline must move past the final save's cover to re-arm the rule, for a
# policy whose margin is smaller (see SavePolicy.rearm_after_seconds): more than the
# rounding of an answer to whole seconds, and than the jitter of a clock.
REARM_FLOOR_SECONDS = 2.0

LATE_SAVES_EXPECTED = "expected"  # try_late_saves: when the unpadded time still fits
# try_late_saves (default): "expected" when the deadline is the machine's end, False when
# it is the process's (a SIGTERM grace, a Slurm time limit, or not known to be the machine's).
LATE_SAVES_AUTO = "auto"

# Statistic name -> quantile used for the step estimate (nearest-rank, so with fewer than
# 1/(1-q) samples a percentile is the max: conservative while little is known).
STATISTICS = {"max": 1.0, "p95": 0.95, "p99": 0.99}


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


def check_seconds(name: str, value: object) -> float:
    """``value`` as a float if it is a finite number of seconds >= 0, else ValueError naming
    ``name``. Shared with ``sidecar.train.client`` and the integrations: one rule for every
    duration a user passes in."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number of seconds, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return float(value)


def seed_rule(
    remaining_seconds: Optional[float],
    step_seconds: float,
    save_seconds: float,
    redundant_seconds: float,
) -> tuple[bool, float]:
    """The seed rule: save when ``0 < remaining <= step + save + redundant``.

    Returns ``(save_now, budget_seconds)``. No deadline, or one already passed, never
    asks for a save: there is nothing left to save before. The one implementation, used
    by :class:`SavePolicy`, the daemon's ``/v1/decision``, ``esi-sidecar check`` and
    :func:`verl_rule`.
    """
    budget = step_seconds + save_seconds + redundant_seconds
    save_now = remaining_seconds is not None and 0 < remaining_seconds <= budget
    return save_now, budget


def verl_rule(
    remaining_seconds: Optional[float],
    max_steps_duration: float,
    save_ckpt_duration: float,
    redundant_time: float,
) -> bool:
    """verl's ``should_save_ckpt_esi`` (``verl/utils/checkpoint/checkpoint_manager.py``):
    the seed rule, and False while ``max_steps_duration`` is not > 0 (no step measured).
    Stateless: True at every step inside the window. Used by the verl drop-in and the
    simulator's ``verl`` policy."""
    save_now, _budget = seed_rule(
        remaining_seconds, max_steps_duration, save_ckpt_duration, redundant_time
    )
    return max_steps_duration > 0 and save_now


def _check_count(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return value


def quantile(values: Sequence[float], q: float) -> float:
    """Nearest-rank quantile: an actually observed value, never an interpolation."""
    ordered = sorted(values)
    rank = max(1, math.ceil(q * len(ordered)))
    return ordered[rank - 1]


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
      estimate (save and upload x ``save_margin``): True always, False never, "expected"
      when the unpadded time still fits, "auto" (default) as "expected" when the deadline
      is the machine's end (a release or a reclaim notice served by the daemon) and as
      False when it is the process's (a SIGTERM grace, a Slurm time limit, a deadline from
      the environment): docs/simulation.md, "Late saves". A cut save loses only steps lost
      anyway, but keeps a SIGTERM'd job from leaving cleanly, which is what its scheduler
      reads (exit 75: requeue); a machine that goes takes the process with it either way.
      Once the deadline has passed with no save made for it, the machine runs on
      borrowed time: one best-effort save is always asked, then stop.
    - ``routine_seconds``: routine saves, asked by the guard through the same save path
      (``sidecar.train.routine``). ``"auto"`` (default): only while a running source's
      notice (or the SIGTERM grace) is shorter than step + save + upload, every
      sqrt(2 x save x mean time between reclaims); a number: every that many seconds,
      always; None: never (the behaviour before). Any save restarts the interval.
    - ``fallback_saves``: True (default): one save before the final one when the final
      one rests on an upload longer than the margin, timed so that its own upload ends
      before the final save starts (``sidecar.train.fallback``); False: none (before).

    Invalid values raise ``ValueError`` naming the argument: this is the user's own code,
    so failing at construction is better than a wrong decision hours later.
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
    # Steps trained since the final save; -1 once the top-up save was made; inf before a
    # final save (see steps_after_final()).
    _after_final: float = field(default=math.inf, init=False, repr=False)
    # Training since the last save ("auto": what a cut save loses); the last margin kept.
    _at_risk_seconds: float = field(default=0.0, init=False, repr=False)
    _margin_seconds: float = field(default=DEFAULT_REDUNDANT_SECONDS, init=False, repr=False)

    def __post_init__(self) -> None:
        self.save_seconds = check_seconds("save_seconds", self.save_seconds)
        if self.redundant_seconds != AUTO:
            self.redundant_seconds = check_seconds("redundant_seconds", self.redundant_seconds)
            self._margin_seconds = self.redundant_seconds
        if self.try_late_saves not in (True, False, LATE_SAVES_EXPECTED, LATE_SAVES_AUTO):
            raise ValueError("try_late_saves: True, False, 'expected' or 'auto': "
                             f"{self.try_late_saves!r}")
        self.window = _check_count("window", self.window)
        self.save_window = _check_count("save_window", self.save_window)
        if self.statistic not in STATISTICS:
            raise ValueError(
                f"statistic must be one of {', '.join(STATISTICS)}, got {self.statistic!r}"
            )
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

    # ------------------------------------------------------------------ measurements

    def record_step(self, seconds: float) -> None:
        """Add one measured training step: one pass of the loop between two decisions
        (data loading included), not counting saves.

        Also ends the cover that the last save had only for having nothing unsaved after
        it (see :meth:`record_save`).
        """
        self._steps.append(check_seconds("seconds", seconds))
        self._at_risk_seconds += seconds
        self._fresh_cover_until_unix = None
        if 0 <= self._after_final < math.inf:
            self._after_final += 1

    def record_save(
        self,
        seconds: float,
        *,
        started_unix: float,
        deadline_unix: Optional[float],
        budget_seconds: Optional[float] = None,
        fallback: bool = False,
    ) -> None:
        """Add one measured save that started at ``started_unix`` (wall clock).

        ``deadline_unix``: the deadline known when the save started (None if none was
        known); the guard passes the one its last "save now?" decision used. Required,
        so that no caller forgets it and silently gets the wrong cover.

        Every save is measured (it teaches the policy the save time). It also becomes the
        final save, and covers deadlines, only when it could have been made for the
        known deadline: ``deadline_unix`` is not None and ``deadline_unix <= started_unix
        + budget``, the rule's own window. The checkpoint holds the training state of
        ``started_unix``, so such a save covers every deadline up to ``started_unix +
        budget``: saving again before such a deadline would not lose less work than the
        rule accepts. A save made with no deadline known, or with the deadline still
        outside the window (a routine save), covers nothing once training goes on: a
        deadline learned later gets its own save, and the training done since the
        routine save is kept (found by the simulator: ``sidecar+periodic-30`` missed on
        spot notices). Until the next :meth:`record_step`, though, any save covers up to
        ``started_unix + budget``: with nothing trained since, it is as fresh as a save
        made now, so a deadline learned while it was written needs no second save.

        The budget used is the largest of ``budget_seconds`` (the one the save decision
        used, passed by the guard), the budget before this measurement and the budget
        after it, so a save that turns out faster than assumed never shrinks the cover
        below the decision that asked for it (which would re-arm at once and save twice).

        ``fallback``: the save was the fallback save (``sidecar.train.fallback``): it is
        measured and resets the training at risk, but covers nothing, not even until the
        next step: the deadline it was made before still gets its final save.
        """
        seconds = check_seconds("seconds", seconds)
        if not math.isfinite(started_unix):
            raise ValueError(f"started_unix must be finite, got {started_unix!r}")
        if deadline_unix is not None and not math.isfinite(deadline_unix):
            raise ValueError(f"deadline_unix must be finite or None, got {deadline_unix!r}")
        before = self._budget(self.step_estimate(), self.save_estimate())
        self._saves.append(seconds)
        self._at_risk_seconds = 0.0
        after = self._budget(self.step_estimate(), self.save_estimate())
        budget = max(before, after, budget_seconds or 0.0)
        cover = started_unix + budget
        if fallback:
            return
        self._fresh_cover_until_unix = cover
        if deadline_unix is None or deadline_unix > cover:
            return  # a routine save: not made for any deadline
        if self._cover_until_unix is None or (
            deadline_unix > self._cover_until_unix + self.rearm_after_seconds()
        ):
            self._after_final = 0  # the final save for this deadline: a top-up may follow
        elif self._after_final > 0:
            self._after_final = -1  # a save after training past the final save: the top-up
        # A later save never shrinks what an earlier one covers.
        if self._cover_until_unix is None or cover > self._cover_until_unix:
            self._cover_until_unix = cover

    # ------------------------------------------------------------------ resume

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

    # ------------------------------------------------------------------ estimates

    def step_estimate(self) -> Optional[float]:
        """``T_max_step``: the chosen statistic over the window; None before any step."""
        if not self._steps:
            return None
        return quantile(list(self._steps), STATISTICS[self.statistic])

    def typical_step_estimate(self) -> Optional[float]:
        """The median step of the window (None before any step): what the top-up save
        bets the next step takes. A top-up that meets a rare slow step (a validation
        step, a straggler) is cut by the release, and the final checkpoint stands; the
        final save itself keeps budgeting ``statistic`` (the max by default)."""
        if not self._steps:
            return None
        return quantile(list(self._steps), 0.5)

    def measured_save_estimate(self) -> Optional[float]:
        """The largest of the recent measured saves times ``save_margin``; None if none."""
        if not self._saves:
            return None
        return max(self._saves) * self.save_margin

    def save_estimate(self) -> float:
        """``T_save``: the configured value until a save was measured, then measured only.

        Choice: once a save has been measured, the measurement replaces the configured
        value, in both directions. The configured 60 s is a guess made before anything
        was known; a save measured on this machine, this model and this storage is
        better evidence, and keeping a too-large guess as a floor would start the final
        save early and lose up to that much training for nothing. The margin (x1.2) and
        taking the largest of the last ``save_window`` saves cover normal variation.
        """
        measured = self.measured_save_estimate()
        return self.save_seconds if measured is None else measured

    def covered_seconds(self, now_unix: float) -> Optional[float]:
        """How far beyond ``now_unix`` the saves made for a deadline cover; None if none.

        Routine saves (no deadline known, or it was outside their window) count only
        until the next step (see :meth:`record_save`).

        Negative when the cover ended in the past. Exposed so that the guard can reduce
        it across ranks (the largest wins: any rank's save covers everyone).
        """
        covers = [c for c in (self._cover_until_unix, self._fresh_cover_until_unix)
                  if c is not None]
        if not covers:
            return None
        return max(covers) - now_unix

    def forget_cover(self) -> None:
        """The deadline the saves were made for moved beyond their cover (a renewal; the
        guard calls this on the decision that says so, :attr:`PolicyDecision.rearmed`).

        What they cover stays true of their checkpoints, but the loop trains on now: a
        deadline that later comes back within that cover (a SIGTERM soon after a
        renewal, the release brought forward again) finds work no save holds, and must
        get a save of its own instead of counting as covered (and, after a top-up, stopping
        at once without one: found on a real Slurm job, ``scontrol update TimeLimit=+5``
        then a preemption).
        """
        self._cover_until_unix = None
        self._fresh_cover_until_unix = None
        self._after_final = math.inf

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
        return self._after_final

    def rearm_after_seconds(self) -> float:
        """How far past the final save's cover a deadline must move to re-arm the rule:
        the margin (``redundant_seconds``, at least :data:`REARM_FLOOR_SECONDS`).

        Chosen so (issue 13): the margin is what the rule keeps for clock error, so a
        deadline moved later by less is noise the final save already budgeted for; a
        loop that trains on past ``stop`` makes the top-up save for it, not a second
        final save. A renewal moves the release by hours, far beyond it. A fixed number
        of seconds would not fit a rule scaled down to seconds (tests, the demo).
        """
        return max(self._margin_seconds, REARM_FLOOR_SECONDS)

    def margin_for(self, step_seconds: Optional[float], durable_save: float,
                   upload_seconds: Optional[float]) -> float:
        """The margin to keep now (:func:`sidecar.train.margin.margin_for`)."""
        return margin_for(
            self.redundant_seconds, steps=list(self._steps), saves=list(self._saves),
            step_seconds=step_seconds, durable_save=durable_save,
            upload_seconds=upload_seconds, at_risk_seconds=self._at_risk_seconds)

    def _budget(self, step_seconds: Optional[float], save_seconds: float) -> float:
        return (step_seconds or 0.0) + save_seconds + self._margin_seconds

    # ------------------------------------------------------------------ decisions

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

    def decide(
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
    ) -> PolicyDecision:
        """The rule from explicit inputs (the guard passes values reduced across ranks).

        ``upload_seconds``: how long a checkpoint takes to become durable after the local
        save (the daemon's uploader estimate); the rule then budgets step + save + upload
        + margin, since the machine's local disk goes with it. None or 0: the local save
        is durable.

        ``covered_seconds``: how far beyond now the saves made for a deadline cover (see
        :meth:`covered_seconds`). The deadline is covered, and the policy disarmed, when
        ``remaining_seconds <= covered_seconds + rearm_after_seconds()``; a deadline
        moved later than that re-arms it. A deadline brought earlier stays covered.

        ``steps_after_final``: see :meth:`steps_after_final` (None: this policy's own).
        ``typical_step_seconds``: the step the top-up save budgets (see
        :meth:`typical_step_estimate`; None: ``step_seconds``). ``margin_seconds``: the
        margin agreed across ranks (None: :meth:`margin_for`). ``at_risk_seconds``: the
        training since the last save, for the fallback save (None: this policy's own).
        ``machine_deadline``: the deadline is the machine's end (a release, a reclaim
        notice), not the process's (a SIGTERM grace, a Slurm time limit); None: not known,
        taken as the process's by ``try_late_saves="auto"``; False also means no fallback
        save (``sidecar.train.fallback``).
        """
        durable_save = save_seconds + (upload_seconds or 0.0)
        if margin_seconds is not None or (remaining_seconds is not None and step_seconds):
            self._margin_seconds = margin_seconds if margin_seconds is not None else (
                self.margin_for(step_seconds, durable_save, upload_seconds))
        budget = None if step_seconds is None else self._budget(step_seconds, durable_save)

        def decision(save_now: bool, stop: bool, reason: str, top_up: bool = False,
                     too_late: bool = False, best_effort: bool = False,
                     fallback: bool = False) -> PolicyDecision:
            rearmed = (covered_seconds is not None and remaining_seconds is not None
                       and not covered)
            return PolicyDecision(
                save_now=save_now,
                stop=stop,
                remaining_seconds=remaining_seconds,
                budget_seconds=budget,
                step_seconds=step_seconds,
                save_seconds=save_seconds,
                reason=reason,
                upload_seconds=upload_seconds,
                top_up=top_up,
                too_late=too_late,
                best_effort=best_effort,
                rearmed=rearmed,
                fallback=fallback,
            )

        covered = False
        if remaining_seconds is None:
            return decision(False, False, "no deadline known")
        covered = covered_seconds is not None and (
            remaining_seconds <= covered_seconds + self.rearm_after_seconds()
        )
        if covered:
            after = self._after_final if steps_after_final is None else steps_after_final
            typical = step_seconds if typical_step_seconds is None else typical_step_seconds
            return self._after_final_save(
                remaining_seconds, typical, save_seconds, upload_seconds, after, decision
            )
        if remaining_seconds <= 0:
            # The machine still runs past its announced end (a notice learned late, a
            # clock step, a release running behind) and nothing was saved for it: every
            # step trained from here is lost with the machine, and a save cut by the
            # release costs nothing (the atomic commit keeps the previous checkpoint). So
            # one best-effort save, then the saves cover the deadline and the rule says
            # stop (issue 22, item 2; docs/checkpoints.md).
            return decision(
                True, False,
                f"deadline passed {-remaining_seconds:.1f} s ago with no save made for it: "
                "best-effort save now", best_effort=True,
            )
        if step_seconds is None:
            return decision(False, False, "no step measured yet")
        assert budget is not None  # a step was measured
        reason = self._fallback_reason(remaining_seconds, budget, step_seconds, save_seconds,
                                       upload_seconds, at_risk_seconds, machine_deadline)
        if reason is not None:
            return decision(True, False, reason, fallback=True)
        if seed_rule(remaining_seconds, step_seconds, durable_save, self._margin_seconds)[0]:
            if remaining_seconds < durable_save and not self._tries_late(
                    remaining_seconds, durable_save, machine_deadline):
                return decision(
                    False, False,
                    f"remaining {remaining_seconds:.1f} s < {durable_save:.1f} s for a save"
                    + (" and its upload" if upload_seconds else "")
                    + ": it would be cut by the release; not starting one",
                    too_late=True,
                )
            return decision(
                True,
                False,
                f"remaining {remaining_seconds:.1f} s <= budget {budget:.1f} s: save now",
            )
        return decision(
            False, False, f"remaining {remaining_seconds:.1f} s > budget {budget:.1f} s"
        )

    def _fallback_reason(self, remaining_seconds: float, budget_seconds: float,
                             step_seconds: float, save_seconds: float,
                             upload_seconds: Optional[float],
                             at_risk_seconds: Optional[float],
                             machine_deadline: Optional[bool]) -> Optional[str]:
        """Why a fallback save is due now (``sidecar.train.fallback``), None if none is,
        ``fallback_saves`` is off, or the deadline is the process's (a SIGTERM grace: one
        save and leave; the upload goes on after the process)."""
        if not self.fallback_saves or machine_deadline is False:
            return None
        return fallback_reason(
            remaining_seconds, budget_seconds=budget_seconds, step_seconds=step_seconds,
            save_seconds=save_seconds, upload_seconds=upload_seconds,
            margin_seconds=self._margin_seconds,
            at_risk_seconds=self._at_risk_seconds if at_risk_seconds is None
            else at_risk_seconds)

    def _tries_late(self, remaining_seconds: float, durable_save: float,
                    machine_deadline: Optional[bool]) -> bool:
        if self.try_late_saves == LATE_SAVES_AUTO and not machine_deadline:
            return False  # the process's deadline (or not known): a clean exit first
        if self.try_late_saves in (LATE_SAVES_EXPECTED, LATE_SAVES_AUTO):
            # The x save_margin taken off.
            return remaining_seconds >= durable_save / self.save_margin
        return self.try_late_saves is True

    def _after_final_save(
        self,
        remaining_seconds: float,
        step_seconds: Optional[float],
        save_seconds: float,
        upload_seconds: Optional[float],
        steps_after_final: float,
        decision: Callable[..., PolicyDecision],
    ) -> PolicyDecision:
        """Covered by the final save: train on towards one top-up save, or stop.

        ``step_seconds`` here is the typical step (the median), not the max: a top-up
        that meets a rarer slow step is cut, and the final checkpoint stands. The top-up
        is durable ``save + upload`` after it starts, plus, when the upload of
        the final checkpoint may still be running when the top-up lands one step after it,
        what is left of that upload (the uploader finishes the final checkpoint first).
        """
        margin = self.top_up_seconds
        if margin is None or steps_after_final < 0 or step_seconds is None:
            return decision(False, True, "saved for this deadline; stop")
        upload = upload_seconds or 0.0
        backlog = max(0.0, upload - (step_seconds + save_seconds))
        durable = save_seconds + upload + backlog + margin
        if remaining_seconds > step_seconds + durable:
            return decision(False, False, f"saved for this deadline; remaining "
                            f"{remaining_seconds:.1f} s > {step_seconds + durable:.1f} s: "
                            "training on towards a top-up save", top_up=True)
        if steps_after_final > 0 and remaining_seconds >= durable and remaining_seconds > 0:
            return decision(True, False, f"remaining {remaining_seconds:.1f} s <= "
                            f"{step_seconds + durable:.1f} s: top-up save now", top_up=True)
        return decision(False, True, "saved for this deadline; no further step fits: stop")


def _short(seconds: float) -> str:
    if seconds >= 7200:
        return f"{seconds / 3600:.1f} h"
    if seconds >= 600:
        return f"{seconds / 60:.0f} min"
    return f"{seconds:.0f} s"


def fallback_reason(
    remaining_seconds: float,
    *,
    budget_seconds: float,
    step_seconds: float,
    save_seconds: float,
    upload_seconds: Optional[float],
    margin_seconds: float,
    at_risk_seconds: float,
) -> Optional[str]:
    """Why a fallback save is due now, or None when none is (module docstring).

    ``budget_seconds``: the final save's budget; ``save_seconds`` and ``upload_seconds``:
    the estimates in it (``upload_seconds`` None or 0: the local save is durable, no
    fallback); ``at_risk_seconds``: training since the last save."""
    upload = upload_seconds or 0.0
    if upload <= margin_seconds:
        return None
    lead = step_seconds + save_seconds + upload
    if at_risk_seconds < max(10.0 * save_seconds, lead):
        return None
    if not budget_seconds + upload < remaining_seconds <= budget_seconds + lead:
        return None
    return (f"remaining {remaining_seconds:.1f} s <= {budget_seconds + lead:.1f} s: fallback "
            f"save now, durable before the final save starts (its {upload:.0f} s upload is "
            f"longer than the {margin_seconds:.0f} s margin; "
            f"{_short(at_risk_seconds)} trained since the last save)")


def with_routine(decision: PolicyDecision, overdue: Optional[float]) -> PolicyDecision:
    """The guard's routine overlay, as it was (sidecar/train/guard.py at e745773)."""
    if overdue is None or overdue < 0 or decision.save_now or decision.stop or (
            decision.top_up or decision.too_late):
        return decision
    return replace(decision, save_now=True, routine=True, reason=f"{decision.reason}; "
                   "routine save: no notice holds a save (SavePolicy.routine_seconds)")
