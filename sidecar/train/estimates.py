"""The estimates the save rule reads: pure, standard library only, no clock, no I/O.

Everything here is a function of numbers passed in (issue 37: ``sidecar.train.rule`` and
this module import only the stdlib, the shared modules and each other):

- :func:`quantile`, the nearest-rank statistic the step estimate takes over its window;
- the margin kept before the release (``SavePolicy(redundant_seconds="auto")``, issue 23,
  item 4): the one that minimises the expected loss per release::

      loss(m) = m + P(cut | m) x (work at risk + budget)

  ``m`` is the training the margin gives up when the save ends in time; ``P(cut | m)``
  (:func:`cut_probability`) the chance that the next step, the save and its upload
  outlast the budget plus ``m`` minus the notice latency (step and save: the sums of their
  measured windows' means and variances, a normal tail widened for few samples,
  :func:`spread`; the upload: the daemon's estimate as it is). A cut save loses the work
  since the last checkpoint and the time spent on the save. The margin never goes below
  the notice latency nor above the fixed margin it replaces; with too few measurements, it
  is the fixed margin (:func:`choose_margin`, :func:`margin_for`);
- the routine saves' interval (``sidecar.train.routine`` says why): Young's
  ``sqrt(2 x save x mean time between reclaims)`` (:func:`young_daly_seconds`), its floor
  (:func:`routine_floor_seconds`) and the mean time between reclaims, assumed per source
  (:func:`reclaim_every`) or measured (:func:`measured_reclaim_every`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional, Union

__all__ = [
    "AUTO",
    "DEFAULT_NOTICE_LATENCY_SECONDS",
    "DEFAULT_RECLAIM_EVERY_SECONDS",
    "FALLBACK_RECLAIM_EVERY_SECONDS",
    "FIXED_MARGIN_SECONDS",
    "FLOOR_SAVES",
    "FLOOR_SECONDS",
    "MIN_SAVES",
    "MIN_STEPS",
    "STATISTICS",
    "MarginChoice",
    "choose_margin",
    "cut_probability",
    "margin_for",
    "measured_reclaim_every",
    "quantile",
    "reclaim_every",
    "routine_floor_seconds",
    "spread",
    "young_daly_seconds",
]

HOUR = 3600.0

# Statistic name -> quantile used for the step estimate (nearest-rank, so with fewer than
# 1/(1-q) samples a percentile is the max: conservative while little is known).
STATISTICS = {"max": 1.0, "p95": 0.95, "p99": 0.99}


def quantile(values: Sequence[float], q: float) -> float:
    """Nearest-rank quantile: an actually observed value, never an interpolation."""
    ordered = sorted(values)
    rank = max(1, math.ceil(q * len(ordered)))
    return ordered[rank - 1]


# The word that asks SavePolicy for a chosen margin instead of a fixed one.
AUTO = "auto"

# The fixed margin "auto" falls back on and never exceeds: the seed's 120 s
# (policy.DEFAULT_REDUNDANT_SECONDS).
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


# The floor on the automatic interval (see the module's docstring): at least this many
# saves' worth of training between two routine saves, and at least this long.
FLOOR_SAVES = 10.0
FLOOR_SECONDS = 300.0

# The mean time between reclaims assumed for a source until the daemon measured one: a
# CHOSEN default, the same for every reclaimable kind. The published figures are fleet
# averages that say little about one GPU type in one zone (AWS's Spot Instance Advisor
# gives a monthly "frequency of interruption" band per instance type, ">20 %" the worst;
# GCP stops a preemptible VM after 24 h at the latest and has quoted 5-15 % preempted per
# day; Azure publishes no rate), and GPU capacity is the most contended. A short figure
# errs towards more saves, and the cost of a wrong guess is mild: with r = assumed / true,
# the expected waste is (sqrt(r) + 1 / sqrt(r)) / 2 times the optimum (1.25 x at r = 4).
FALLBACK_RECLAIM_EVERY_SECONDS = 6 * HOUR
DEFAULT_RECLAIM_EVERY_SECONDS: dict[str, float] = {
    "aws": 6 * HOUR,  # spot interruption (2 min notice)
    "gcp": 6 * HOUR,  # spot / preemptible (30 s); a preemptible VM lives 24 h at most
    "azure": 6 * HOUR,  # spot eviction (30 s)
    "volcengine-spot": 6 * HOUR,  # spot reclaim (5 min)
    "volcengine-events": 6 * HOUR,  # its shortest event: a spot reclaim
    "SIGTERM": 6 * HOUR,  # a platform that only sends SIGTERM (Kubernetes, Slurm)
}


def young_daly_seconds(save_seconds: float, reclaim_every_seconds: float) -> float:
    """sqrt(2 x save cost x mean time between reclaims), at least the save itself."""
    return max(save_seconds, math.sqrt(2.0 * save_seconds * reclaim_every_seconds))


def routine_floor_seconds(save_seconds: float) -> float:
    """The shortest automatic interval: FLOOR_SAVES x the save, at least FLOOR_SECONDS."""
    return max(FLOOR_SAVES * save_seconds, FLOOR_SECONDS)


def reclaim_every(sources: Sequence[str]) -> float:
    """The default mean time between reclaims of these sources together (rates add)."""
    if not sources:
        return FALLBACK_RECLAIM_EVERY_SECONDS
    rate = sum(1.0 / DEFAULT_RECLAIM_EVERY_SECONDS.get(s, FALLBACK_RECLAIM_EVERY_SECONDS)
               for s in sources)
    return 1.0 / rate


def measured_reclaim_every(machine_seconds: Sequence[float], prior_seconds: float
                           ) -> Optional[float]:
    """The mean time between reclaims from the lives of the machines that were reclaimed
    (each release's start to its end), with the default as one more life: a gamma prior
    of one pseudo-reclaim, so one short-lived machine does not halve the interval at
    once. None without a measured life. The machine running now is left out: that errs
    short, towards more saves."""
    lives = [s for s in machine_seconds if math.isfinite(s) and s > 0]
    if not lives:
        return None
    return (prior_seconds + sum(lives)) / (1 + len(lives))
