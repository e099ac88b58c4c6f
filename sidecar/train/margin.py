"""The margin the save rule keeps before the release, chosen to lose the least: pure.

Standard library only, no clock, no I/O (``SavePolicy(redundant_seconds="auto")``, issue
23, item 4). The fixed 120 s is idle time whenever the final save ends in time, which is
nearly always; it only pays when the save, its step or the deadline run late. So the
margin ``m`` is the one that minimises the expected loss per release::

    loss(m) = m + P(cut | m) x (work at risk + budget)

- the first term: the training the margin gives up when the save ends in time (the save
  starts ``m`` earlier than the estimates ask);
- ``P(cut | m)``: the chance that the next step, the save and its upload outlast the
  budget plus ``m`` minus the notice latency. The step and the save are the sums of their
  measured windows' means, with their variances (a normal tail, wider than the bounded
  spread of real steps and saves, widened again for few samples); the upload is the
  daemon's estimate, budgeted as it is (the estimate is the daemon's bound on the slow
  tail, ``sidecar.host.upload.plan``). The release is taken to come one notice latency
  before the deadline the job knows (a deadline moved while the daemon was between polls);
- a cut save loses the work since the last checkpoint and the time spent on the save.

The margin never goes below the notice latency nor above the fixed margin it replaces;
with too few measurements, it is the fixed margin.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional, Union

__all__ = [
    "AUTO",
    "DEFAULT_NOTICE_LATENCY_SECONDS",
    "FIXED_MARGIN_SECONDS",
    "MIN_SAVES",
    "MIN_STEPS",
    "MarginChoice",
    "choose_margin",
    "cut_probability",
    "margin_for",
    "spread",
]

# The word that asks SavePolicy for a chosen margin instead of a fixed one.
AUTO = "auto"

# The fixed margin "auto" falls back on and never exceeds: the seed's 120 s
# (policy.DEFAULT_REDUNDANT_SECONDS, which imports this module).
FIXED_MARGIN_SECONDS = 120.0

# How late a deadline change may reach the job: the daemon's default poll interval (30 s);
# the guard's own refresh (1 s) is inside it.
DEFAULT_NOTICE_LATENCY_SECONDS = 30.0

# Measurements needed before the dispersion is trusted: below, the fixed margin.
MIN_STEPS = 10
MIN_SAVES = 3

# The margins tried, in seconds: whole seconds from the floor to the fixed margin.
GRID_SECONDS = 1.0


@dataclass(frozen=True)
class MarginChoice:
    """The chosen margin and what it was weighed with (for logs and the simulator)."""

    margin_seconds: float
    cut_probability: float  # at the chosen margin
    expected_loss_seconds: float  # loss(m) above
    reason: str


def spread(values: Sequence[float]) -> tuple[float, float]:
    """Mean and standard deviation of ``values`` for predicting the next one: the sample
    deviation (n - 1) widened by sqrt(1 + 1/n), the prediction interval's factor, so that a
    few samples are not read as a tight distribution. ``(0, 0)`` for no values."""
    count = len(values)
    if not count:
        return 0.0, 0.0
    mean = sum(values) / count
    if count < 2:
        return mean, 0.0
    variance = sum((value - mean) ** 2 for value in values) / (count - 1)
    return mean, math.sqrt(variance * (1 + 1 / count))


def cut_probability(margin_seconds: float, *, slack_seconds: float, sigma_seconds: float,
                    notice_latency_seconds: float) -> float:
    """P(the step, save and upload outlast the budget + margin - latency): a normal tail.

    ``slack_seconds``: the budget without the margin minus the expected step + save +
    upload (what the x1.2 and the max already keep); ``sigma_seconds``: the deviation of
    step + save."""
    headroom = slack_seconds + margin_seconds - notice_latency_seconds
    if sigma_seconds <= 0:
        return 0.0 if headroom >= 0 else 1.0
    return 0.5 * math.erfc(headroom / (sigma_seconds * math.sqrt(2)))


def choose_margin(
    *,
    steps: Sequence[float],
    saves: Sequence[float],
    budget_seconds: float,
    upload_seconds: float,
    at_risk_seconds: float,
    fixed_margin_seconds: float,
    notice_latency_seconds: float = DEFAULT_NOTICE_LATENCY_SECONDS,
) -> MarginChoice:
    """The margin that minimises the expected loss (module docstring).

    ``steps``, ``saves``: the recent measured durations; ``budget_seconds``: what the rule
    budgets without the margin (step estimate + save estimate + upload);
    ``upload_seconds``: the upload in it; ``at_risk_seconds``: the training since the last
    checkpoint; ``fixed_margin_seconds``: the margin used with too few measurements, and
    the largest one tried.
    """
    if len(steps) < MIN_STEPS or len(saves) < MIN_SAVES:
        return MarginChoice(fixed_margin_seconds, 0.0, fixed_margin_seconds,
                            f"fewer than {MIN_STEPS} steps or {MIN_SAVES} saves measured: "
                            f"the fixed {fixed_margin_seconds:g} s")
    step_mean, step_sigma = spread(steps)
    save_mean, save_sigma = spread(saves)
    sigma = math.hypot(step_sigma, save_sigma)
    slack = budget_seconds - (step_mean + save_mean + upload_seconds)
    penalty = max(0.0, at_risk_seconds) + budget_seconds
    floor = min(notice_latency_seconds, fixed_margin_seconds)
    best = None
    margin = floor
    while margin <= fixed_margin_seconds + 1e-9:
        cut = cut_probability(margin, slack_seconds=slack, sigma_seconds=sigma,
                              notice_latency_seconds=notice_latency_seconds)
        loss = margin + cut * penalty
        if best is None or loss < best[2] - 1e-12:
            best = (margin, cut, loss)
        margin += GRID_SECONDS
    assert best is not None  # the floor is always tried
    margin, cut, loss = best
    return MarginChoice(margin, cut, loss,
                        f"margin {margin:g} s: P(cut) {cut:.2g} x {penalty:.0f} s at risk "
                        f"against {margin:g} s kept (step + save {step_mean + save_mean:.0f} "
                        f"+- {sigma:.0f} s, {slack:.0f} s slack in the estimates)")


def margin_for(
    redundant_seconds: Union[float, str],
    *,
    steps: Sequence[float],
    saves: Sequence[float],
    step_seconds: Optional[float],
    durable_save: float,
    upload_seconds: Optional[float],
    at_risk_seconds: float,
) -> float:
    """The margin :class:`~sidecar.train.policy.SavePolicy` keeps: ``redundant_seconds``
    as it is, or with :data:`AUTO` the one :func:`choose_margin` picks for the budget
    ``step_seconds + durable_save`` (the fixed one before a step was measured)."""
    if redundant_seconds != AUTO:
        return float(redundant_seconds)
    if step_seconds is None:
        return FIXED_MARGIN_SECONDS
    return choose_margin(steps=steps, saves=saves, budget_seconds=step_seconds + durable_save,
                         upload_seconds=upload_seconds or 0.0, at_risk_seconds=at_risk_seconds,
                         fixed_margin_seconds=FIXED_MARGIN_SECONDS).margin_seconds
