"""The save rule, one table: ``decide(situation) -> decision``. Pure: no clock, no I/O.

The situation is gathered once (``SavePolicy.situation``: the guard's numbers, reduced
across ranks, and the policy's own); :func:`decide` reads the rows below in order and the
first that holds decides. The table is the code: :func:`decide` has one ``if`` per row, in
this order (tests/train/test_rule.py checks both), and docs/save-rule.md is generated
from it (``tools/save_rule_doc.py``), with a worked example per row.

Words: *remaining* the time left before the deadline; *durable* the save estimate plus
the upload after it; *budget* step + durable + margin (the seed's window); *covered*
remaining <= the saves' cover + the re-arm margin (max(margin, 2 s)); *needed* the
top-up's typical step + durable + what is left of the final upload + ``top_up_seconds``.

ROWS
| row | action | when |
| SIGTERM_SAVED | stop | covered, and a SIGTERM came: one save, then leave |
| SAVED | stop | covered, and no top-up: off, made already, or no step measured |
| TOP_UP_TRAIN | train | covered, and remaining > needed: train on towards the top-up |
| TOP_UP_SAVE | save | covered, a step trained since the final save, durable top-up fits |
| NOTHING_FITS | stop | covered, and no further step fits before the deadline |
| BEST_EFFORT | save | the deadline passed with no save made for it |
| FALLBACK | save | one durable save beyond the budget, upload > margin, work at risk |
| TOO_LATE | train | in the budget, but remaining < durable and no late save is tried |
| WINDOW | save | 0 < remaining <= budget: the final save |
| ROUTINE | save | a routine save is due (no notice holds a save) |
| NO_DEADLINE | train | no deadline known |
| NO_STEP | train | no step measured yet |
| OUTSIDE_WINDOW | train | remaining > budget |
END

Late saves (``TOO_LATE``): ``late_saves`` True always tries, False never, "expected" when
remaining >= durable / ``save_margin`` (the padding taken off), "auto" as "expected" for a
machine's deadline and as False for any other. The fallback save (``FALLBACK``, see
``sidecar.train.fallback``) is never made for a process's deadline (a SIGTERM grace, a
Slurm limit, the environment's): there the rule is one save and leave.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Optional, Union

from sidecar.train.deadlines import MACHINE, PROCESS_SOURCES, daemon_kind
from sidecar.train.estimates import FLOOR_SAVES

__all__ = [
    "ARMED",
    "PROCESS_SOURCES",
    "REARM_FLOOR_SECONDS",
    "TOPPED_UP",
    "Action",
    "DeadlineKind",
    "Decision",
    "Phase",
    "Settings",
    "Situation",
    "Stage",
    "Why",
    "deadline_kind",
    "decide",
    "fallback_due",
    "final_saved",
    "render",
]

# The least a deadline must move past the final save's cover to re-arm the rule, for a
# margin smaller than that: more than an answer's rounding to whole seconds and a clock's
# jitter (SavePolicy.rearm_after_seconds).
REARM_FLOOR_SECONDS = 2.0



class Action(Enum):
    TRAIN = "train"
    SAVE = "save"
    STOP = "stop"


class DeadlineKind(Enum):
    """Whose end the deadline is. A drill rehearses the kind of the deadline it stands for."""

    MACHINE = "machine"  # a release or a reclaim notice the daemon serves
    PROCESS = "process"  # a SIGTERM grace, a Slurm time limit, the environment's deadline
    UNKNOWN = "unknown"  # not said (a SavePolicy asked without the guard)


def deadline_kind(source: Optional[str], daemon_source: Optional[str],
                  served: Optional[str] = None) -> DeadlineKind:
    """The kind of a deadline the guard read from ``source`` ("daemon", "env", "slurm",
    "sigterm"): the daemon's the kind it ``served`` (its own source being
    ``daemon_source``, which an older daemon's kind is guessed from:
    ``sidecar.train.deadlines.daemon_kind``); every other a process's."""
    machine = source == "daemon" and daemon_kind(served, daemon_source) == MACHINE
    return DeadlineKind.MACHINE if machine else DeadlineKind.PROCESS


class Stage(Enum):
    ARMED = "armed"  # no final save for the deadline yet
    FINAL_SAVED = "final-saved"  # the final save made, ``steps`` trained since
    TOPPED_UP = "topped-up"  # the top-up after it made too


@dataclass(frozen=True)
class Phase:
    """Where the policy is between a deadline's saves: ARMED, FINAL_SAVED(n), TOPPED_UP."""

    stage: Stage
    steps: int = 0  # trained since the final save (FINAL_SAVED only)

    def steps_after_final(self) -> float:
        """As the ranks' vote carries it (MIN): inf armed, n, -1 topped up."""
        if self.stage is Stage.ARMED:
            return math.inf
        return -1.0 if self.stage is Stage.TOPPED_UP else float(self.steps)

    @staticmethod
    def of_steps_after_final(value: float) -> Phase:
        if value < 0:
            return TOPPED_UP
        return ARMED if math.isinf(value) else final_saved(int(value))


ARMED = Phase(Stage.ARMED)
TOPPED_UP = Phase(Stage.TOPPED_UP)


def final_saved(steps: int) -> Phase:
    return Phase(Stage.FINAL_SAVED, steps)


@dataclass(frozen=True)
class Settings:
    """The options the rows read (``SavePolicy``'s)."""

    top_up_seconds: Optional[float] = 5.0
    fallback_saves: bool = True
    late_saves: Union[bool, str] = "auto"
    save_margin: float = 1.2


@dataclass(frozen=True)
class Situation:
    """Everything the rule reads, gathered once (seconds)."""

    remaining_seconds: Optional[float]  # None: no deadline known
    step_seconds: Optional[float]  # the step statistic (max); None: none measured
    typical_step_seconds: Optional[float]  # the median step, what a top-up bets on
    save_seconds: float  # the save estimate
    upload_seconds: Optional[float]  # from the save's end to durable; None: local is durable
    margin_seconds: float  # kept before the release (fixed, or chosen: estimates)
    covered_seconds: Optional[float] = None  # how far beyond now the saves cover
    phase: Phase = ARMED
    at_risk_seconds: float = 0.0  # trained since the last save
    kind: DeadlineKind = DeadlineKind.UNKNOWN
    settings: Settings = Settings()
    sigterm: bool = False  # a SIGTERM came (the guard's grace)
    routine_overdue_seconds: Optional[float] = None  # >= 0: a routine save is due

    # The three below are plain functions the properties call, so that the mutation
    # check (docs/mutation.md) reaches them: mutmut leaves decorated functions alone.
    @property
    def durable_seconds(self) -> float:
        return _durable_seconds(self)

    @property
    def budget_seconds(self) -> Optional[float]:
        return _budget_seconds(self)

    @property
    def covered(self) -> bool:
        return _covered(self)


def _durable_seconds(s: Situation) -> float:
    return s.save_seconds + (s.upload_seconds or 0.0)


def _budget_seconds(s: Situation) -> Optional[float]:
    if s.step_seconds is None:
        return None
    return s.step_seconds + s.durable_seconds + s.margin_seconds


def _covered(s: Situation) -> bool:
    return (s.remaining_seconds is not None and s.covered_seconds is not None
            and s.remaining_seconds <= s.covered_seconds
            + max(s.margin_seconds, REARM_FLOOR_SECONDS))


class Why(Enum):
    """The row that decided (its name in the table)."""

    SIGTERM_SAVED = "sigterm-saved"
    SAVED = "saved"
    TOP_UP_TRAIN = "top-up-train"
    TOP_UP_SAVE = "top-up-save"
    NOTHING_FITS = "nothing-fits"
    BEST_EFFORT = "best-effort"
    FALLBACK = "fallback"
    TOO_LATE = "too-late"
    WINDOW = "window"
    ROUTINE = "routine"
    NO_DEADLINE = "no-deadline"
    NO_STEP = "no-step"
    OUTSIDE_WINDOW = "outside-window"


@dataclass(frozen=True)
class Decision:
    """The action, the row that chose it, and the numbers its text is rendered from."""

    action: Action
    why: Why
    numbers: Mapping[str, float]
    rearmed: bool = False  # the deadline moved beyond the saves' cover (a renewal)

    @property
    def text(self) -> str:
        return render(self.why, self.numbers)


def _short(seconds: float) -> str:
    if seconds >= 7200:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 60:.0f} min" if seconds >= 600 else f"{seconds:.0f} s"


def render(why: Why, n: Mapping[str, float]) -> str:
    """The decision's line, from its row and numbers."""
    r = n.get("remaining", math.nan)
    if why is Why.SIGTERM_SAVED or why is Why.SAVED:
        return "saved for this deadline; stop"
    if why is Why.TOP_UP_TRAIN:
        return (f"saved for this deadline; remaining {r:.1f} s > {n['needed']:.1f} s: "
                "training on towards a top-up save")
    if why is Why.TOP_UP_SAVE:
        return f"remaining {r:.1f} s <= {n['needed']:.1f} s: top-up save now"
    if why is Why.NOTHING_FITS:
        return "saved for this deadline; no further step fits: stop"
    if why is Why.BEST_EFFORT:
        return (f"deadline passed {-r:.1f} s ago with no save made for it: "
                "best-effort save now")
    if why is Why.FALLBACK:
        return (f"remaining {r:.1f} s <= {n['budget'] + n['lead']:.1f} s: fallback save now, "
                f"durable before the final save starts (its {n['upload']:.0f} s upload is "
                f"longer than the {n['margin']:.0f} s margin; "
                f"{_short(n['at_risk'])} trained since the last save)")
    if why is Why.TOO_LATE:
        return (f"remaining {r:.1f} s < {n['durable']:.1f} s for a save"
                + (" and its upload" if n.get("upload") else "")
                + ": it would be cut by the release; not starting one")
    if why is Why.WINDOW:
        return f"remaining {r:.1f} s <= budget {n['budget']:.1f} s: save now"
    if why is Why.ROUTINE:
        under = (Why.NO_DEADLINE if "remaining" not in n else Why.NO_STEP
                 if "budget" not in n else Why.OUTSIDE_WINDOW)
        return (f"{render(under, n)}; routine save: no notice holds a save "
                "(SavePolicy.routine_seconds)")
    if why is Why.NO_DEADLINE:
        return "no deadline known"
    if why is Why.NO_STEP:
        return "no step measured yet"
    return f"remaining {r:.1f} s > budget {n['budget']:.1f} s"


def _numbers(s: Situation, **more: float) -> dict[str, float]:
    known = {"remaining": s.remaining_seconds, "budget": s.budget_seconds,
             "step": s.step_seconds, "save": s.save_seconds, "upload": s.upload_seconds,
             "durable": s.durable_seconds, "margin": s.margin_seconds,
             "at_risk": s.at_risk_seconds}
    return {**{k: v for k, v in known.items() if v is not None}, **more}


def _tries_late(s: Situation, remaining: float) -> bool:
    late = s.settings.late_saves
    if late == "auto" and s.kind is not DeadlineKind.MACHINE:
        return False  # the process's deadline (or not known): a clean exit first
    if late in ("expected", "auto"):
        return remaining >= s.durable_seconds / s.settings.save_margin  # padding off
    return late is True


def fallback_due(s: Situation, remaining: float, budget: float, step: float) -> bool:
    """One durable save beyond the final save's budget (``sidecar.train.fallback``)."""
    upload = s.upload_seconds or 0.0
    lead = step + s.save_seconds + upload
    return (s.settings.fallback_saves and s.kind is not DeadlineKind.PROCESS
            and upload > s.margin_seconds
            and s.at_risk_seconds >= max(FLOOR_SAVES * s.save_seconds, lead)
            and budget + upload < remaining <= budget + lead)


def decide(s: Situation) -> Decision:
    """The first row of the table (module docstring) that holds."""
    r, step, budget = s.remaining_seconds, s.step_seconds, s.budget_seconds
    covered = s.covered
    typical, top_up = s.typical_step_seconds, s.settings.top_up_seconds
    upload = s.upload_seconds or 0.0
    backlog = 0.0 if typical is None else max(0.0, upload - (typical + s.save_seconds))
    top_up_durable = s.save_seconds + upload + backlog + (top_up or 0.0)
    needed = (typical or 0.0) + top_up_durable
    lead = (step or 0.0) + s.save_seconds + upload
    n = _numbers(s, needed=needed, lead=lead)
    rearmed = s.covered_seconds is not None and r is not None and not covered

    def decided(action: Action, why: Why) -> Decision:
        return Decision(action, why, n, rearmed)

    if covered and s.sigterm:
        return decided(Action.STOP, Why.SIGTERM_SAVED)
    if covered and (top_up is None or s.phase is TOPPED_UP or typical is None):
        return decided(Action.STOP, Why.SAVED)
    if covered and r is not None and r > needed:
        return decided(Action.TRAIN, Why.TOP_UP_TRAIN)
    if covered and r is not None and s.phase.steps_after_final() > 0 and (
            r >= top_up_durable and r > 0):
        return decided(Action.SAVE, Why.TOP_UP_SAVE)
    if covered:
        return decided(Action.STOP, Why.NOTHING_FITS)
    if r is not None and r <= 0:
        return decided(Action.SAVE, Why.BEST_EFFORT)
    if r is not None and step is not None and budget is not None and fallback_due(
            s, r, budget, step):
        return decided(Action.SAVE, Why.FALLBACK)
    if r is not None and budget is not None and 0 < r <= budget and (
            r < s.durable_seconds and not _tries_late(s, r)):
        return decided(Action.TRAIN, Why.TOO_LATE)
    if r is not None and budget is not None and 0 < r <= budget:
        return decided(Action.SAVE, Why.WINDOW)
    if s.routine_overdue_seconds is not None and s.routine_overdue_seconds >= 0:
        return decided(Action.SAVE, Why.ROUTINE)
    if r is None:
        return decided(Action.TRAIN, Why.NO_DEADLINE)
    if step is None:
        return decided(Action.TRAIN, Why.NO_STEP)
    return decided(Action.TRAIN, Why.OUTSIDE_WINDOW)
