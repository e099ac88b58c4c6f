"""Each row of the save rule's table at its edges (sidecar.train.rule): the value where a
row starts to hold, and the one just before. Found by the mutation check (docs/mutation.md):
every test here fails on a change of one comparison or one default in the rule.

Numbers are exact in binary floating point (the save margin 1.25, not 1.2), so that an
edge is the edge and not a rounding away from it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from sidecar.train.estimates import FLOOR_SAVES
from sidecar.train.rule import (
    Action,
    DeadlineKind,
    Settings,
    Situation,
    Why,
    decide,
    final_saved,
)


def situation(**changes: Any) -> Situation:
    """Step 10 s, save 60 s, no upload, the 120 s margin, a machine's deadline."""
    base = Situation(remaining_seconds=None, step_seconds=10.0, typical_step_seconds=10.0,
                     save_seconds=60.0, upload_seconds=None, margin_seconds=120.0,
                     kind=DeadlineKind.MACHINE)
    return replace(base, **changes)


def why(**changes: Any) -> Why:
    return decide(situation(**changes)).why


# --- covered: remaining <= cover + the re-arm margin, the edge included ---------------------

def test_a_deadline_exactly_at_the_cover_plus_margin_is_still_covered() -> None:
    top_up_off = Settings(top_up_seconds=None)
    assert why(remaining_seconds=120.0, covered_seconds=0.0, settings=top_up_off) is Why.SAVED
    # One second beyond it, the rule is re-armed: the final save's window again.
    decision = decide(situation(remaining_seconds=121.0, covered_seconds=0.0,
                                settings=top_up_off))
    assert decision.why is Why.WINDOW and decision.rearmed


def test_rearmed_only_when_a_cover_is_known_a_deadline_is_known_and_it_moved_beyond() -> None:
    assert decide(situation(remaining_seconds=500.0, covered_seconds=0.0)).rearmed
    assert not decide(situation(remaining_seconds=100.0, covered_seconds=0.0)).rearmed
    assert not decide(situation(remaining_seconds=None, covered_seconds=0.0)).rearmed
    assert not decide(situation(remaining_seconds=500.0, covered_seconds=None)).rearmed


# --- late saves: "auto" tries from durable / save_margin on, the edge included --------------

def test_a_late_save_is_tried_from_the_unpadded_estimate_on() -> None:
    late = Settings(save_margin=1.25)  # 60 s / 1.25 = 48 s exactly
    assert why(remaining_seconds=48.0, settings=late) is Why.WINDOW
    assert why(remaining_seconds=47.5, settings=late) is Why.TOO_LATE


def test_too_late_is_strictly_less_than_the_durable_estimate() -> None:
    never = Settings(late_saves=False)
    assert why(remaining_seconds=60.0, settings=never) is Why.WINDOW  # exactly durable: fits
    assert why(remaining_seconds=59.5, settings=never) is Why.TOO_LATE


def test_too_late_holds_down_to_the_last_instant_before_the_deadline() -> None:
    never = Settings(late_saves=False)
    assert why(remaining_seconds=0.5, settings=never) is Why.TOO_LATE


def test_the_final_save_is_made_down_to_the_last_instant_before_the_deadline() -> None:
    assert why(remaining_seconds=0.5, settings=Settings(late_saves=True)) is Why.WINDOW


def test_best_effort_starts_at_the_deadline_not_before() -> None:
    assert why(remaining_seconds=0.0) is Why.BEST_EFFORT
    assert why(remaining_seconds=-3.0) is Why.BEST_EFFORT
    assert why(remaining_seconds=0.5, settings=Settings(late_saves=True)) is Why.WINDOW


# --- the top-up: from top_up_durable on, and never at the deadline --------------------------

def covered_after_final(**changes: Any) -> Situation:
    """The final save made one step ago, its cover reaching the deadline."""
    return situation(covered_seconds=1000.0, phase=final_saved(1), **changes)


def test_a_top_up_whose_durable_time_equals_the_time_left_is_made() -> None:
    # top_up_durable = save 60 + top_up_seconds 5 = 65 s; needed = 10 + 65 = 75 s.
    assert decide(covered_after_final(remaining_seconds=65.0)).why is Why.TOP_UP_SAVE
    assert decide(covered_after_final(remaining_seconds=64.5)).why is Why.NOTHING_FITS
    assert decide(covered_after_final(remaining_seconds=76.0)).why is Why.TOP_UP_TRAIN


def test_no_top_up_at_or_after_the_deadline_even_when_it_costs_nothing() -> None:
    free = Settings(top_up_seconds=0.0)
    at_deadline = covered_after_final(remaining_seconds=0.0, save_seconds=0.0, settings=free)
    assert decide(at_deadline).why is Why.NOTHING_FITS
    just_before = covered_after_final(remaining_seconds=0.5, save_seconds=0.5, settings=free)
    assert decide(just_before).why is Why.TOP_UP_SAVE


# --- the numbers: what is unknown counts as zero --------------------------------------------

def test_an_unknown_step_typical_step_top_up_and_upload_count_as_nothing() -> None:
    numbers = decide(situation(remaining_seconds=1000.0, step_seconds=None,
                               typical_step_seconds=None, upload_seconds=None,
                               settings=Settings(top_up_seconds=None))).numbers
    assert numbers["needed"] == 60.0 and numbers["lead"] == 60.0


# --- the fallback save ----------------------------------------------------------------------

# Step 10, save 20, upload 200 > margin 120: durable 220, budget 350, lead 230; the work at
# risk must reach max(FLOOR_SAVES x 20, 230) = 230; the fallback's window is (550, 580].
FALLBACK = dict(save_seconds=20.0, upload_seconds=200.0, at_risk_seconds=1000.0)


def test_the_fallback_window_is_open_below_and_closed_above() -> None:
    assert FLOOR_SAVES * 20.0 < 230.0  # the lead is the larger
    assert why(remaining_seconds=550.0, **FALLBACK) is Why.OUTSIDE_WINDOW
    assert why(remaining_seconds=550.5, **FALLBACK) is Why.FALLBACK
    assert why(remaining_seconds=580.0, **FALLBACK) is Why.FALLBACK
    assert why(remaining_seconds=580.5, **FALLBACK) is Why.OUTSIDE_WINDOW
    # Between the budget and budget + upload: not yet a fallback (its upload would not end
    # before the final save starts).
    assert why(remaining_seconds=351.0, **FALLBACK) is Why.OUTSIDE_WINDOW


def test_the_work_at_risk_must_reach_the_lead_the_edge_included() -> None:
    assert why(remaining_seconds=560.0, **{**FALLBACK, "at_risk_seconds": 230.0}) is Why.FALLBACK
    assert why(remaining_seconds=560.0,
               **{**FALLBACK, "at_risk_seconds": 229.5}) is Why.OUTSIDE_WINDOW


def test_the_work_at_risk_must_reach_floor_saves_saves_where_that_is_more() -> None:
    # Save 60: FLOOR_SAVES x 60 = 600 s > the lead 270 s. Budget 390; window (590, 660].
    heavy = dict(save_seconds=60.0, upload_seconds=200.0)
    assert FLOOR_SAVES * 60.0 > 270.0
    assert why(remaining_seconds=600.0, at_risk_seconds=FLOOR_SAVES * 60.0,
               **heavy) is Why.FALLBACK
    assert why(remaining_seconds=600.0, at_risk_seconds=270.0, **heavy) is Why.OUTSIDE_WINDOW


@pytest.mark.parametrize("upload", [120.0, 50.0])
def test_no_fallback_unless_the_upload_is_longer_than_the_margin(upload: float) -> None:
    # Upload 120 (= the margin) or 50: budget 310 or 240; any remaining beyond the budget
    # is outside the window, however much work is at risk.
    for remaining in (300.0, 400.0, 450.0, 500.0):
        decision = decide(situation(remaining_seconds=remaining, save_seconds=60.0,
                                    upload_seconds=upload, at_risk_seconds=10_000.0))
        budget = 10.0 + 60.0 + upload + 120.0
        expected = Why.OUTSIDE_WINDOW if remaining > budget else Why.WINDOW
        assert decision.why is expected, remaining


def test_no_upload_is_no_upload_even_with_a_margin_under_a_second() -> None:
    # Margin 0.5 s and no upload: budget 70.5 s; beyond it, no fallback.
    assert why(remaining_seconds=100.0, margin_seconds=0.5,
               at_risk_seconds=10_000.0) is Why.OUTSIDE_WINDOW


# --- routine saves: due from 0 s overdue on -------------------------------------------------

def test_a_routine_save_is_due_the_moment_its_interval_ends() -> None:
    assert why(routine_overdue_seconds=0.0) is Why.ROUTINE
    assert why(routine_overdue_seconds=0.5) is Why.ROUTINE
    assert why(routine_overdue_seconds=-0.5) is Why.NO_DEADLINE
    assert decide(situation(routine_overdue_seconds=0.0)).action is Action.SAVE
