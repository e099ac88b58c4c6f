"""The chosen margin: plain numbers in, the margin that loses least out (no clock, no I/O)."""

from __future__ import annotations

import math

import pytest

from sidecar.train.margin import (
    DEFAULT_NOTICE_LATENCY_SECONDS,
    MIN_SAVES,
    MIN_STEPS,
    choose_margin,
    cut_probability,
    spread,
)

STEPS = [19.0, 20.0, 21.0] * 4  # 12 steps: mean 20, a tight spread


def choose(saves: list[float], *, at_risk: float = 6000.0, steps: list[float] = STEPS,
           padding: float = 1.2, upload: float = 0.0, latency: float = 30.0) -> float:
    # The rule's budget as SavePolicy builds it: the max step, the largest save x 1.2.
    budget = max(steps) + max(saves) * padding + upload
    return choose_margin(steps=steps, saves=saves, budget_seconds=budget,
                         upload_seconds=upload, at_risk_seconds=at_risk,
                         fixed_margin_seconds=120.0,
                         notice_latency_seconds=latency).margin_seconds


def test_spread_widens_the_sample_deviation_for_few_samples() -> None:
    mean, sigma = spread([10.0, 20.0])
    assert mean == 15.0
    # Sample deviation 7.07 (n - 1), times sqrt(1 + 1/2).
    assert sigma == pytest.approx(math.sqrt(50.0) * math.sqrt(1.5))
    assert spread([]) == (0.0, 0.0)
    assert spread([7.0]) == (7.0, 0.0)


def test_cut_probability_is_a_normal_tail_past_the_latency() -> None:
    # Headroom = slack + margin - latency; one sigma of headroom: about 16 %.
    p = cut_probability(40.0, slack_seconds=0.0, sigma_seconds=10.0, notice_latency_seconds=30.0)
    assert p == pytest.approx(0.1587, abs=1e-4)
    assert cut_probability(30.0, slack_seconds=0.0, sigma_seconds=10.0,
                           notice_latency_seconds=30.0) == pytest.approx(0.5)
    # No spread: certain either way.
    assert cut_probability(30.0, slack_seconds=0.0, sigma_seconds=0.0,
                           notice_latency_seconds=30.0) == 0.0
    assert cut_probability(29.0, slack_seconds=0.0, sigma_seconds=0.0,
                           notice_latency_seconds=30.0) == 1.0


def test_too_few_measurements_keep_the_fixed_margin() -> None:
    saves = [200.0] * MIN_SAVES
    assert choose(saves[:-1]) == 120.0
    assert choose(saves, steps=STEPS[: MIN_STEPS - 1]) == 120.0
    choice = choose_margin(steps=STEPS, saves=saves[:1], budget_seconds=300.0,
                           upload_seconds=0.0, at_risk_seconds=1.0, fixed_margin_seconds=40.0)
    assert choice.margin_seconds == 40.0 and "fixed 40 s" in choice.reason


def test_steady_saves_need_no_more_than_the_notice_latency() -> None:
    # Saves of 195 s +- 2 s: the x1.2 on the largest keeps 40 s of slack, far beyond the
    # spread; the margin is the latency floor.
    saves = [193.0, 195.0, 197.0, 194.0, 196.0]
    assert choose(saves) == DEFAULT_NOTICE_LATENCY_SECONDS
    assert choose(saves, latency=10.0) == 10.0


def test_a_wide_save_spread_with_no_padding_buys_a_larger_margin() -> None:
    # Saves 150-240 s and no x1.2: the largest measured save is all the budget keeps, so
    # the tail of the next save needs margin beyond the latency.
    saves = [150.0, 240.0, 170.0, 220.0, 195.0]
    wide = choose(saves, padding=1.0)
    assert DEFAULT_NOTICE_LATENCY_SECONDS < wide < 120.0
    # More work at risk is worth more margin; none at all is worth the floor only.
    assert choose(saves, padding=1.0, at_risk=60_000.0) > wide
    assert choose(saves, padding=1.0, at_risk=0.0) <= wide


def test_the_margin_minimises_the_expected_loss() -> None:
    # Brute force over the same grid: loss(m) = m + P(cut | m) x (at risk + budget).
    saves = [150.0, 240.0, 170.0, 220.0, 195.0]
    budget = 21.0 + 240.0
    choice = choose_margin(steps=STEPS, saves=saves, budget_seconds=budget,
                           upload_seconds=0.0, at_risk_seconds=6000.0,
                           fixed_margin_seconds=120.0)
    step_mean, step_sigma = spread(STEPS)
    save_mean, save_sigma = spread(saves)
    sigma = math.hypot(step_sigma, save_sigma)
    slack = budget - step_mean - save_mean

    def loss(m: float) -> float:
        return m + cut_probability(m, slack_seconds=slack, sigma_seconds=sigma,
                                   notice_latency_seconds=30.0) * (6000.0 + budget)

    assert choice.expected_loss_seconds == pytest.approx(loss(choice.margin_seconds))
    assert all(loss(m) >= choice.expected_loss_seconds - 1e-9 for m in range(30, 121))
    assert 0 < choice.cut_probability < 0.01


def test_the_upload_estimate_is_budgeted_as_it_is() -> None:
    # A 360 s upload estimate counts as 360 s (no slack taken from it): the same margin
    # as without an upload.
    saves = [44.0, 45.0, 46.0, 45.0, 44.0]
    assert choose(saves, upload=360.0) == choose(saves)
