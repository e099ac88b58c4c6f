"""The save rule, driven step by step with an explicit clock (no I/O, no sleeps)."""

from __future__ import annotations

import math
from typing import Optional

import pytest

from sidecar.train.policy import PolicyDecision, SavePolicy

NOW = 1_800_000_000.0  # any fixed wall-clock instant


def policy_with_step(step: float = 80.0, **options: object) -> SavePolicy:
    policy = SavePolicy(**options)  # type: ignore[arg-type]
    policy.record_step(step)
    return policy


# ---------------------------------------------------------------- the rule itself


def test_worked_example_from_the_docs_saves_now() -> None:
    # 200 s left, 80 s step, 60 s save, 120 s redundant: budget 260 > 200 -> save now.
    policy = policy_with_step(80.0, save_seconds=60.0, redundant_seconds=120.0)
    decision = policy.evaluate(NOW, NOW + 200.0)
    assert decision.save_now
    assert not decision.stop
    assert decision.budget_seconds == pytest.approx(260.0)
    assert decision.remaining_seconds == pytest.approx(200.0)
    assert decision.step_seconds == 80.0
    assert decision.save_seconds == 60.0
    assert "save now" in decision.reason


def test_outside_the_window_does_not_save() -> None:
    policy = policy_with_step(80.0)
    decision = policy.evaluate(NOW, NOW + 261.0)
    assert not decision.save_now
    assert not decision.stop
    assert policy.evaluate(NOW, NOW + 260.0).save_now  # the boundary is inclusive


def test_defaults_match_the_contract() -> None:
    policy = SavePolicy()
    assert (policy.save_seconds, policy.redundant_seconds, policy.window) == (60.0, 120.0, 100)
    assert policy.statistic == "max"
    assert policy.save_estimate() == 60.0


def test_no_decision_before_the_first_step() -> None:
    policy = SavePolicy()
    decision = policy.evaluate(NOW, NOW + 100.0)
    assert decision == PolicyDecision(
        save_now=False,
        stop=False,
        remaining_seconds=100.0,
        budget_seconds=None,
        step_seconds=None,
        save_seconds=60.0,
        reason="no step measured yet",
    )
    policy.record_step(1.0)
    assert policy.evaluate(NOW, NOW + 100.0).save_now


def test_unknown_deadline_never_saves() -> None:
    decision = policy_with_step().evaluate(NOW, None)
    assert not decision.save_now and not decision.stop
    assert decision.remaining_seconds is None
    assert decision.reason == "no deadline known"


@pytest.mark.parametrize("remaining", [0.0, -0.001, -1.0, -2.0, -100.0, -3600.0])
@pytest.mark.parametrize("try_late_saves", [False, True])
def test_a_passed_deadline_with_no_save_gets_one_best_effort_save_then_stop(
    remaining: float, try_late_saves: bool
) -> None:
    # Issue 22, item 2: "deadline passed" used to mean no save and no stop, and the loop
    # trained on unprotected until the machine died.
    policy = SavePolicy(try_late_saves=try_late_saves)
    policy.record_step(10.0)
    decision = policy.evaluate(NOW, NOW + remaining)
    assert decision.save_now and decision.best_effort and not decision.stop
    assert not decision.top_up and not decision.too_late
    assert "best-effort save now" in decision.reason
    policy.record_save(5.0, started_unix=NOW, deadline_unix=NOW + remaining,
                       budget_seconds=decision.budget_seconds)
    after = policy.evaluate(NOW + 5.0, NOW + remaining)
    assert not after.save_now and after.stop


def test_a_deadline_that_jumps_into_the_past_gets_a_save_and_a_stop() -> None:
    policy = policy_with_step()
    assert not policy.evaluate(NOW, NOW + 4000.0).save_now  # far: nothing to do
    jumped = policy.evaluate(NOW + 1.0, NOW - 1.0)  # learned late: 2 s in the past
    assert jumped.save_now and jumped.best_effort


def test_a_passed_deadline_already_saved_for_stops_without_another_save() -> None:
    policy = policy_with_step()
    final = policy.evaluate(NOW, NOW + 150.0)
    assert final.save_now and not final.best_effort
    policy.record_save(5.0, started_unix=NOW, deadline_unix=NOW + 150.0,
                       budget_seconds=final.budget_seconds)
    passed = policy.evaluate(NOW + 151.0, NOW + 150.0)
    assert not passed.save_now and passed.stop


# ---------------------------------------------------------------- step estimate


def test_step_estimate_is_a_sliding_window_not_the_max_since_start() -> None:
    policy = SavePolicy(window=3)
    policy.record_step(500.0)  # a slow first step (compilation, warm-up)
    for _ in range(3):
        policy.record_step(10.0)
    assert policy.step_estimate() == 10.0  # the warm-up step fell out of the window
    decision = policy.evaluate(NOW, NOW + 250.0)
    assert decision.budget_seconds == pytest.approx(190.0)
    assert not decision.save_now  # the running max since start (verl) would save here


def test_max_p95_p99_over_the_window() -> None:
    steps = [float(n) for n in range(1, 101)]  # 1 .. 100 s
    estimates = {}
    for statistic in ("max", "p95", "p99"):
        policy = SavePolicy(statistic=statistic)
        for seconds in steps:
            policy.record_step(seconds)
        estimates[statistic] = policy.step_estimate()
    # Nearest rank: observed values, never interpolated.
    assert estimates == {"max": 100.0, "p95": 95.0, "p99": 99.0}


def test_percentile_ignores_a_rare_outlier_and_max_does_not() -> None:
    p95, worst = SavePolicy(statistic="p95"), SavePolicy(statistic="max")
    for policy in (p95, worst):
        for index in range(100):
            policy.record_step(300.0 if index == 50 else 2.0)
    assert p95.step_estimate() == 2.0
    assert worst.step_estimate() == 300.0


def test_percentile_with_few_samples_is_the_max() -> None:
    policy = SavePolicy(statistic="p95")
    for seconds in (1.0, 2.0, 9.0):
        policy.record_step(seconds)
    assert policy.step_estimate() == 9.0  # conservative while little is known


# ---------------------------------------------------------------- save estimate


def test_save_estimate_follows_measured_saves_with_margin() -> None:
    policy = SavePolicy(save_seconds=60.0, save_margin=1.2, save_window=2)
    assert policy.measured_save_estimate() is None
    policy.record_save(10.0, started_unix=NOW, deadline_unix=None)
    assert policy.save_estimate() == pytest.approx(12.0)  # a fast save lowers it
    policy.record_save(100.0, started_unix=NOW + 1, deadline_unix=None)
    assert policy.save_estimate() == pytest.approx(120.0)  # the largest recent one
    policy.record_save(20.0, started_unix=NOW + 2, deadline_unix=None)
    assert policy.save_estimate() == pytest.approx(120.0)
    policy.record_save(20.0, started_unix=NOW + 3, deadline_unix=None)
    assert policy.save_estimate() == pytest.approx(24.0)  # the slow one aged out


def test_measured_save_changes_the_budget() -> None:
    policy = policy_with_step(80.0, save_seconds=60.0, redundant_seconds=120.0)
    policy.record_save(5.0, started_unix=NOW - 10_000, deadline_unix=None)  # a routine save
    decision = policy.evaluate(NOW, NOW + 250.0)
    assert decision.budget_seconds == pytest.approx(80 + 6 + 120)
    assert not decision.save_now


# ---------------------------------------------------------------- once per deadline
# These pin the final save and its cover alone (top_up_seconds=None); the top-up save
# that may follow it is pinned further down.


def test_saves_once_per_deadline_then_stops() -> None:
    deadline = NOW + 200.0
    policy = policy_with_step(80.0, top_up_seconds=None)
    first = policy.evaluate(NOW, deadline)
    assert first.save_now and not first.stop
    policy.record_save(
        30.0, started_unix=NOW, deadline_unix=deadline, budget_seconds=first.budget_seconds
    )

    after = policy.evaluate(NOW + 30.0, deadline)
    assert not after.save_now
    assert after.stop
    assert "saved for this deadline" in after.reason
    # Still inside the window on every later step: the seed rule would save again here.
    for elapsed in (40.0, 120.0, 199.0):
        policy.record_step(80.0)
        decision = policy.evaluate(NOW + elapsed, deadline)
        assert not decision.save_now and decision.stop


def test_faster_than_assumed_save_does_not_rearm() -> None:
    # Saved at 255 s left with the assumed 60 s save; the measured 10 s shrinks the
    # budget to 212 s, but the save must still cover its deadline.
    deadline = NOW + 255.0
    policy = policy_with_step(80.0, top_up_seconds=None)
    assert policy.evaluate(NOW, deadline).save_now
    policy.record_save(10.0, started_unix=NOW, deadline_unix=deadline)
    decision = policy.evaluate(NOW + 10.0, deadline)
    assert decision.budget_seconds == pytest.approx(212.0)
    assert not decision.save_now and decision.stop


def test_rearms_when_the_deadline_moves_later_than_the_save_covers() -> None:
    policy = policy_with_step(80.0, top_up_seconds=None)
    deadline = NOW + 200.0
    assert policy.evaluate(NOW, deadline).save_now
    policy.record_save(30.0, started_unix=NOW, deadline_unix=deadline)
    policy.record_step(80.0)  # training went on: only the cover for the deadline is left

    # A small shift stays within the cover (budget 80 + 36 + 120 = 236 s after the save).
    assert policy.evaluate(NOW + 30.0, deadline + 30.0).stop

    # The release is postponed by an hour: training goes on, nothing to save yet...
    later = deadline + 3600.0
    moved = policy.evaluate(NOW + 30.0, later)
    assert not moved.save_now and not moved.stop
    # ...and the rule fires again, once, when the new deadline comes near.
    near = later - 200.0
    again = policy.evaluate(near, later)
    assert again.save_now
    policy.record_save(30.0, started_unix=near, deadline_unix=later)
    assert policy.evaluate(near + 30.0, later).stop


def loop_ignoring_stop(policy: SavePolicy, deadline: float, wobbles: list[float],
                       step: float = 80.0, save: float = 30.0) -> list[PolicyDecision]:
    """A training loop that saves whenever asked and never looks at ``stop``, its deadline
    wobbling by ``wobbles[i]`` at step i (clock jitter, a rounded answer). The saves."""
    now, saves = NOW, []
    for wobble in wobbles:
        decision = policy.evaluate(now, deadline + wobble)
        if decision.remaining_seconds is not None and decision.remaining_seconds <= 0:
            break
        if decision.save_now:
            saves.append(decision)
            policy.record_save(save, started_unix=now, deadline_unix=deadline + wobble,
                               budget_seconds=decision.budget_seconds)
            now += save
        policy.record_step(step)
        now += step
    return saves


def test_a_deadline_wobbling_by_a_second_does_not_rearm_the_final_save() -> None:
    # The save comes at 259.5 s left with a 260 s budget: its cover ends 0.5 s after the
    # deadline, so a deadline read 1 s later used to re-arm the rule and save again.
    policy = policy_with_step(80.0, top_up_seconds=None)
    saves = loop_ignoring_stop(policy, NOW + 259.5, [0.0, 1.0, -1.0, 1.0, 0.6, 1.4])
    assert len(saves) == 1


def test_a_wobbling_deadline_gets_one_final_and_one_top_up_save() -> None:
    policy = policy_with_step(20.0)  # the default 5 s top-up margin
    wobbles = [0.0, 1.0, -0.5, 1.5] * 10
    saves = loop_ignoring_stop(policy, NOW + 199.5, wobbles, step=20.0, save=10.0)
    assert [decision.top_up for decision in saves] == [False, True]


def test_only_a_move_later_than_the_cover_plus_the_margin_rearms() -> None:
    # The margin (redundant_seconds) is kept for clock error: a deadline moved later by
    # less than that past the save's cover is still covered; a renewal beyond it re-arms.
    policy = policy_with_step(80.0, top_up_seconds=None)
    deadline = NOW + 200.0
    assert policy.evaluate(NOW, deadline).save_now
    policy.record_save(30.0, started_unix=NOW, deadline_unix=deadline)
    policy.record_step(80.0)
    cover = NOW + 260.0  # the budget the save was asked for (80 + 60 + 120)
    assert policy.evaluate(NOW + 110.0, cover + 119.0).stop
    renewed = policy.evaluate(NOW + 110.0, cover + 121.0)
    assert not renewed.stop and not renewed.save_now  # armed again, not yet in the window


def test_deadline_brought_earlier() -> None:
    policy = policy_with_step(80.0)
    # Far away: nothing to do. Then a preemption notice brings it close: save now.
    assert not policy.evaluate(NOW, NOW + 86_400.0).save_now
    assert policy.evaluate(NOW, NOW + 150.0).save_now
    policy.record_save(20.0, started_unix=NOW, deadline_unix=NOW + 150.0)
    # Brought earlier again after the save: still covered, no second save (the job
    # stopped right after the save; nothing is at risk), even if a step ran since.
    decision = policy.evaluate(NOW + 20.0, NOW + 60.0)
    assert not decision.save_now and decision.stop
    policy.record_step(20.0)
    assert policy.evaluate(NOW + 40.0, NOW + 60.0).stop


def test_periodic_save_before_the_notice_does_not_disarm_the_rule() -> None:
    # The simulator's case: a routine save at NOW (no deadline known), then a spot-style
    # notice at NOW + 40 with the deadline at NOW + 160. That deadline is within one
    # budget of the save (NOW + 200), but the save was not made for it: the 40 s trained
    # since would be lost by stopping, and another save fits. Save again, once; then stop.
    policy = policy_with_step(20.0, top_up_seconds=None)  # budget 20 + 60 + 120 = 200 s
    assert policy.evaluate(NOW, None).reason == "no deadline known"
    policy.record_save(10.0, started_unix=NOW, deadline_unix=None)
    assert policy.covered_seconds(NOW + 10.0) is not None  # nothing trained since: fresh
    policy.record_step(20.0)
    policy.record_step(20.0)
    assert policy.covered_seconds(NOW + 50.0) is None  # a routine save covers nothing
    deadline = NOW + 160.0
    decision = policy.evaluate(NOW + 50.0, deadline)
    assert decision.save_now and not decision.stop, decision
    assert decision.budget_seconds == pytest.approx(20 + 12 + 120)  # measured save
    policy.record_save(
        10.0, started_unix=NOW + 50.0, deadline_unix=deadline,
        budget_seconds=decision.budget_seconds,
    )
    assert policy.evaluate(NOW + 60.0, deadline).stop
    for elapsed in (80.0, 100.0, 159.0):  # once: never again inside the window
        policy.record_step(20.0)
        decision = policy.evaluate(NOW + elapsed, deadline)
        assert not decision.save_now and decision.stop


def test_save_while_the_deadline_was_far_does_not_cover_it_when_brought_earlier() -> None:
    policy = policy_with_step(80.0, top_up_seconds=None)  # budget 260 s
    far = NOW + 3600.0
    assert not policy.evaluate(NOW, far).save_now
    policy.record_save(20.0, started_unix=NOW, deadline_unix=far)  # a routine save
    policy.record_step(80.0)
    assert policy.covered_seconds(NOW + 100.0) is None
    # Brought within one budget of that save: it was not made for this deadline.
    near = NOW + 250.0
    decision = policy.evaluate(NOW + 100.0, near)
    assert decision.save_now and not decision.stop
    policy.record_save(20.0, started_unix=NOW + 100.0, deadline_unix=near)
    assert policy.evaluate(NOW + 120.0, near).stop


def test_periodic_save_inside_the_window_is_the_final_save() -> None:
    # The deadline is known and inside the window when the user's own periodic save
    # starts (no "save now?" decision passed a budget): that save is the final one.
    policy = policy_with_step(80.0, top_up_seconds=None)  # budget 260 s before the save
    deadline = NOW + 260.0  # on the boundary: the window is inclusive
    assert policy.evaluate(NOW, deadline).save_now
    policy.record_save(10.0, started_unix=NOW, deadline_unix=deadline)
    for elapsed in (10.0, 90.0, 170.0, 250.0):
        decision = policy.evaluate(NOW + elapsed, deadline)
        assert not decision.save_now and decision.stop, decision
        policy.record_step(80.0)


def test_deadline_learned_during_a_routine_save_needs_no_second_save() -> None:
    # The notice arrives while the routine save is being written: with nothing trained
    # since, that checkpoint is as fresh as a new one, so stop rather than train a step
    # and start a save that the release may cut. If training goes on anyway, the rule
    # re-arms for the new work.
    policy = policy_with_step(20.0, top_up_seconds=None)  # budget 200 s
    policy.record_save(60.0, started_unix=NOW, deadline_unix=None)
    deadline = NOW + 170.0
    decision = policy.evaluate(NOW + 60.0, deadline)
    assert decision.stop and not decision.save_now
    policy.record_step(20.0)
    decision = policy.evaluate(NOW + 80.0, deadline)
    assert decision.save_now and not decision.stop


def test_routine_save_does_not_shrink_an_earlier_final_cover() -> None:
    policy = policy_with_step(80.0, top_up_seconds=None)
    deadline = NOW + 200.0
    policy.record_save(10.0, started_unix=NOW, deadline_unix=deadline)  # final: to NOW+260
    policy.record_step(80.0)
    policy.record_save(10.0, started_unix=NOW + 90.0, deadline_unix=None)  # routine
    policy.record_step(80.0)
    assert policy.covered_seconds(NOW + 180.0) == pytest.approx(80.0)
    assert policy.evaluate(NOW + 180.0, deadline).stop


def test_covered_seconds_is_exposed_for_reduction() -> None:
    policy = policy_with_step(80.0)
    assert policy.covered_seconds(NOW) is None
    policy.record_save(10.0, started_unix=NOW, deadline_unix=NOW + 250.0, budget_seconds=300.0)
    assert policy.covered_seconds(NOW + 100.0) == pytest.approx(200.0)
    policy.record_step(80.0)
    assert policy.covered_seconds(NOW + 100.0) == pytest.approx(200.0)


def test_decide_from_reduced_inputs() -> None:
    policy = SavePolicy(top_up_seconds=None)
    decision = policy.decide(100.0, step_seconds=10.0, save_seconds=5.0, covered_seconds=None)
    assert decision.save_now and decision.budget_seconds == pytest.approx(135.0)
    covered = policy.decide(100.0, step_seconds=10.0, save_seconds=5.0, covered_seconds=100.0)
    assert covered.stop and not covered.save_now


# ---------------------------------------------------------------- the top-up save


def final_save(policy: SavePolicy, now: float, deadline: float, seconds: float) -> None:
    decision = policy.evaluate(now, deadline)
    assert decision.save_now and not decision.top_up, decision
    policy.record_save(seconds, started_unix=now, deadline_unix=deadline,
                       budget_seconds=decision.budget_seconds)


def test_top_up_save_uses_the_margin_once_then_stops() -> None:
    # 20 s steps, the final save at 200 s left (20 + 60 + 120) takes 30 s. With 170 s
    # left, a step plus a save (30 x 1.2 = 36 s) plus the 10 s top-up margin fits
    # (66 s): train on, and make the top-up save when the next step would not fit.
    policy = policy_with_step(20.0, top_up_seconds=10.0)
    deadline = NOW + 200.0
    final_save(policy, NOW, deadline, 30.0)
    now = NOW + 30.0
    trained = []
    while True:
        decision = policy.evaluate(now, deadline)
        if decision.save_now or decision.stop:
            break
        assert decision.top_up and "top-up" in decision.reason
        policy.record_step(20.0)
        now += 20.0
        trained.append(now)
    assert decision.save_now and decision.top_up and not decision.stop, decision
    assert deadline - now == pytest.approx(50.0)  # 70 s left > 66 s: one more step, then save
    assert len(trained) == 6
    policy.record_save(30.0, started_unix=now, deadline_unix=deadline,
                       budget_seconds=decision.budget_seconds)
    # 20 s before the release: stop; never a third save for this deadline.
    assert policy.evaluate(now + 30.0, deadline).stop
    policy.record_step(5.0)
    after = policy.evaluate(now + 35.0, deadline)
    assert after.stop and not after.save_now


def test_no_top_up_when_no_step_and_save_fit_after_the_final_save() -> None:
    policy = policy_with_step(20.0, top_up_seconds=10.0)
    deadline = NOW + 120.0  # learned late: 120 s left, inside the 200 s budget
    final_save(policy, NOW, deadline, 60.0)
    decision = policy.evaluate(NOW + 60.0, deadline)  # 60 s left < 20 + 72 + 10
    assert decision.stop and not decision.save_now and not decision.top_up


def test_a_step_slower_than_expected_skips_the_top_up_save() -> None:
    # Training on towards the top-up, a straggler step leaves less than save + margin:
    # no save is started that the release would cut; the final checkpoint stands.
    policy = policy_with_step(20.0, top_up_seconds=10.0)
    deadline = NOW + 200.0
    final_save(policy, NOW, deadline, 30.0)
    assert not policy.evaluate(NOW + 30.0, deadline).stop
    policy.record_step(140.0)
    decision = policy.evaluate(NOW + 170.0, deadline)  # 30 s left < 36 + 10
    assert decision.stop and not decision.save_now


def test_top_up_budgets_the_final_uploads_backlog() -> None:
    # A 100 s upload: the final checkpoint's upload may still run when a top-up lands a
    # step later, and the uploader finishes it first. Top-up durable after 36 s save +
    # 100 s upload + 44 s backlog (100 - 20 - 36) + 10 s margin = 190 s, plus a step.
    policy = policy_with_step(20.0, top_up_seconds=10.0)
    deadline = NOW + 300.0  # the final save's budget: 20 + 60 + 100 + 120
    decision = policy.evaluate(NOW, deadline, upload_seconds=100.0)
    assert decision.save_now and decision.budget_seconds == pytest.approx(300.0)
    policy.record_save(30.0, started_unix=NOW, deadline_unix=deadline,
                       budget_seconds=decision.budget_seconds)
    on = policy.evaluate(NOW + 30.0, deadline, upload_seconds=100.0)  # 270 s > 210 s
    assert not on.stop and not on.save_now and on.top_up
    policy.record_step(20.0)
    # 230 s left: without the backlog (166 s) this would already be the top-up point.
    assert not policy.evaluate(NOW + 70.0, deadline, upload_seconds=100.0).save_now
    top_up = policy.evaluate(NOW + 90.0, deadline, upload_seconds=100.0)  # 210 s <= 210 s
    assert top_up.save_now and top_up.top_up
    assert policy.evaluate(NOW + 115.0, deadline, upload_seconds=100.0).stop  # 185 s < 190 s


def test_a_renewal_after_the_top_up_rearms_both_saves() -> None:
    policy = policy_with_step(20.0, top_up_seconds=10.0)
    deadline = NOW + 200.0
    final_save(policy, NOW, deadline, 30.0)
    policy.record_step(20.0)
    top_up = policy.evaluate(NOW + 140.0, deadline)
    assert top_up.save_now and top_up.top_up
    policy.record_save(30.0, started_unix=NOW + 140.0, deadline_unix=deadline,
                       budget_seconds=top_up.budget_seconds)
    assert policy.evaluate(NOW + 170.0, deadline).stop
    later = deadline + 3600.0  # renewed: the rule re-arms, then a final and a top-up again
    assert not policy.evaluate(NOW + 170.0, later).stop
    policy.record_step(20.0)
    final_save(policy, later - 170.0, later, 30.0)  # budget now 20 + 36 + 120
    policy.record_step(20.0)
    again = policy.evaluate(later - 60.0, later)
    assert again.save_now and again.top_up


def test_top_up_bets_on_a_typical_step_not_the_slowest() -> None:
    # One 200 s validation step in the window: the final save budgets it (max), the
    # top-up budgets the median step (20 s), so it does not give the margin back.
    policy = policy_with_step(20.0, top_up_seconds=10.0)
    for _ in range(4):
        policy.record_step(20.0)
    policy.record_step(200.0)
    assert policy.step_estimate() == 200.0 and policy.typical_step_estimate() == 20.0
    deadline = NOW + 380.0
    final_save(policy, NOW, deadline, 30.0)  # 380 <= 200 + 60 + 120
    policy.record_step(20.0)
    waiting = policy.evaluate(NOW + 50.0, deadline)  # 330 s left > 20 + 36 + 10
    assert not waiting.save_now and not waiting.stop
    # At 60 s left a max-based top-up (200 + 36 + 10) would have been due long ago.
    policy.record_step(20.0)
    top_up = policy.evaluate(NOW + 320.0, deadline)
    assert top_up.save_now and top_up.top_up and "66.0 s" in top_up.reason


def test_top_up_can_be_turned_off() -> None:
    policy = policy_with_step(20.0, top_up_seconds=None)
    final_save(policy, NOW, NOW + 200.0, 30.0)
    assert policy.evaluate(NOW + 30.0, NOW + 200.0).stop


# ---------------------------------------------------------------- short notices


def test_a_save_that_cannot_end_before_the_release_is_not_started() -> None:
    # A 30 s notice (a SIGTERM's grace) and a 60 s save: inside the window, but the save
    # would be cut by the release. Training goes on instead; the reason says why.
    # try_late_saves=False: the 50 s case below fits unpadded (46.7 s), which the default
    # ("expected", test_a_late_save_starts_when_its_unpadded_time_fits) would start.
    policy = policy_with_step(20.0, try_late_saves=False)
    decision = policy.evaluate(NOW, NOW + 30.0)
    assert not decision.save_now and not decision.stop and decision.too_late
    assert "would be cut by the release" in decision.reason
    # With its upload: 50 s left, a 30 s save (x1.2) and a 20 s upload do not end in time.
    policy.record_save(30.0, started_unix=NOW - 5000, deadline_unix=None)
    policy.record_step(20.0)
    assert policy.evaluate(NOW, NOW + 50.0).save_now
    late = policy.evaluate(NOW, NOW + 50.0, upload_seconds=20.0)
    assert late.too_late and "and its upload" in late.reason
    # If the deadline moves later, the rule saves as usual.
    assert policy.evaluate(NOW, NOW + 100.0, upload_seconds=20.0).save_now


def test_try_late_saves_starts_it_anyway() -> None:
    policy = policy_with_step(20.0, try_late_saves=True)
    decision = policy.evaluate(NOW, NOW + 30.0)
    assert decision.save_now and not decision.too_late


# ---------------------------------------------------------------- invalid arguments


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"save_seconds": -1.0}, "save_seconds"),
        ({"save_seconds": math.nan}, "save_seconds"),
        ({"redundant_seconds": -0.5}, "redundant_seconds"),
        ({"redundant_seconds": math.inf}, "redundant_seconds"),
        ({"window": 0}, "window"),
        ({"window": 2.5}, "window"),
        ({"window": True}, "window"),
        ({"save_window": 0}, "save_window"),
        ({"statistic": "median"}, "statistic"),
        ({"save_margin": 0.9}, "save_margin"),
        ({"save_seconds": "60"}, "save_seconds"),
        ({"top_up_seconds": -1.0}, "top_up_seconds"),
        ({"top_up_seconds": math.inf}, "top_up_seconds"),
    ],
)
def test_invalid_arguments_name_the_argument(options: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        SavePolicy(**options)


@pytest.mark.parametrize("seconds", [-1.0, math.nan, math.inf])
def test_invalid_measurements_are_rejected(seconds: float) -> None:
    policy = SavePolicy()
    with pytest.raises(ValueError, match="seconds"):
        policy.record_step(seconds)
    with pytest.raises(ValueError, match="seconds"):
        policy.record_save(seconds, started_unix=NOW, deadline_unix=None)
    assert policy.step_estimate() is None
    assert policy.measured_save_estimate() is None


@pytest.mark.parametrize("deadline", [math.nan, math.inf, -math.inf])
def test_invalid_save_deadline_is_rejected(deadline: float) -> None:
    policy = policy_with_step(80.0)
    with pytest.raises(ValueError, match="deadline_unix"):
        policy.record_save(10.0, started_unix=NOW, deadline_unix=deadline)
    assert policy.measured_save_estimate() is None
    assert policy.covered_seconds(NOW) is None


def test_a_late_save_starts_when_its_unpadded_time_fits() -> None:
    # "expected": 50 s left, a 30 s save x1.2 and a 20 s upload = 56 s
    # padded, 46.7 s without the x1.2: started; 40 s left is too late even unpadded.
    policy = policy_with_step(20.0, try_late_saves="expected")
    policy.record_save(30.0, started_unix=NOW - 5000, deadline_unix=None)
    policy.record_step(20.0)
    assert policy.evaluate(NOW, NOW + 50.0, upload_seconds=20.0).save_now
    assert policy.evaluate(NOW, NOW + 40.0, upload_seconds=20.0).too_late
    with pytest.raises(ValueError, match="try_late_saves"):
        SavePolicy(try_late_saves="sometimes")


def test_auto_late_saves_start_only_before_the_machines_end() -> None:
    # The default, "auto": as "expected" when the deadline is the machine's (the daemon's
    # release or reclaim notice: the process goes with it either way), as False when it is
    # the process's or not known (a SIGTERM'd job first leaves cleanly, exit 75).
    policy = policy_with_step(20.0)
    assert policy.try_late_saves == "auto"
    policy.record_save(30.0, started_unix=NOW - 5000, deadline_unix=None)
    policy.record_step(20.0)

    def decide(remaining: float, machine: Optional[bool]) -> PolicyDecision:
        return policy.decide(remaining, step_seconds=20.0, save_seconds=36.0,
                             covered_seconds=None, upload_seconds=20.0,
                             machine_deadline=machine)

    assert decide(50.0, True).save_now  # 56 s padded, 46.7 s expected: fits
    assert decide(40.0, True).too_late  # not even unpadded
    assert decide(50.0, False).too_late
    assert decide(50.0, None).too_late
    assert policy.evaluate(NOW, NOW + 50.0, upload_seconds=20.0).too_late  # not known
