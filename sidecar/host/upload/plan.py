"""The upload plan: the next upload's estimate, and which upload goes first near the release.

Pure (issue 21, item 4): plain numbers in, plain numbers out; no I/O, no clock, no settings,
standard library only. The daemon's uploader (``status``, ``uploader``) and the simulator
(``sidecar.tools.simulate.engine``) both decide with these functions, so the figures the
simulator prints are the rule the daemon runs. How near is near is a setting
(``--upload-near-release``, its default in ``sidecar.host.settings``), passed in: the
settings module must not load this package when upload is off.

Amounts and rates come in any one unit: the daemon counts bytes and bytes per second; the
simulator counts seconds at rate 1 (an amount is then its own duration).

The rate is the slow tail, not the mean (issue 23, item 3): a mean x 1.2 is beaten by one
slow upload in four when upload times are lognormal (sigma 0.35), and missed 5 of 200
releases on the simulator's ``upload-lognormal``. The p90 of seconds per unit over the last
10 uploads (nearest rank: the slowest below ten, the second slowest at ten) missed none
there, losing 447 s (median) against 459 s for the slowest of 5 and 481 s for p95 over 20;
p80 over 10 missed one. An upload in progress that is slower than that counts at once
(:func:`in_progress_rate`), so a link that slows is seen before the upload ends.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Optional

__all__ = [
    "ESTIMATE_MARGIN",
    "RATE_WINDOW",
    "SIZE_WINDOW",
    "SLOW_QUANTILE",
    "gives_way",
    "in_progress_rate",
    "largest_recent",
    "near_release",
    "next_upload_seconds",
    "throughput",
    "upload_seconds",
]

# The estimate: the largest of the newest SIZE_WINDOW checkpoints over the slow tail of the
# last RATE_WINDOW uploads' rates (the SLOW_QUANTILE of their seconds per unit sent), times
# ESTIMATE_MARGIN (as SavePolicy's margin on measured saves: normal variation, and the fixed
# cost of a small checkpoint).
SIZE_WINDOW = 3
RATE_WINDOW = 10
SLOW_QUANTILE = 0.9
ESTIMATE_MARGIN = 1.2


def _nearest_rank(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(1, math.ceil(q * len(ordered))) - 1]


def throughput(measured: Iterable[tuple[float, float]], cap: Optional[float]) -> Optional[float]:
    """The slow tail of the recent uploads' rates: over their ``(amount, seconds)``, the
    rate of the upload at the ``SLOW_QUANTILE`` of seconds per unit (nearest rank: a rate
    one of them had; below ten uploads, the slowest), at most ``cap``; the cap itself
    before any was measured (None: no cap, nothing measured)."""
    paces = [seconds / amount for amount, seconds in measured if amount > 0 and seconds > 0]
    if not paces:
        return None if cap is None else float(cap)
    rate = 1.0 / _nearest_rank(paces, SLOW_QUANTILE)
    return rate if cap is None else min(rate, cap)


def in_progress_rate(rate: Optional[float], *, sent: float, elapsed_seconds: float,
                     left: float) -> Optional[float]:
    """``rate``, or slower when the upload in progress shows it: having sent ``sent`` in
    ``elapsed_seconds`` with ``left`` to go, it cannot end sooner than if the rest went at
    ``rate``, so its own rate will be at most ``(sent + left) / (elapsed + left / rate)``.
    That bound is sent / elapsed once nothing is left, and never 0 while it starts (a
    first request that has sent nothing yet does not make the estimate infinite)."""
    if not rate or rate <= 0 or elapsed_seconds <= 0 or sent + left <= 0:
        return rate
    return min(rate, (sent + left) / (elapsed_seconds + left / rate))


def largest_recent(sizes: Sequence[float]) -> Optional[float]:
    """The largest of the newest ``SIZE_WINDOW`` checkpoints (``sizes``: newest first)."""
    newest = sizes[:SIZE_WINDOW]
    return max(newest) if newest else None


def upload_seconds(amount: float, rate: float) -> float:
    """How long ``amount`` takes at ``rate``, with the estimate's margin."""
    return amount / rate * ESTIMATE_MARGIN


def next_upload_seconds(sizes: Sequence[float], rate: Optional[float]) -> Optional[float]:
    """The next checkpoint's upload, once saved locally: the largest recent one
    (``sizes``: newest first) at ``rate``, with the margin. None before a checkpoint was
    seen, or while no rate is known."""
    largest = largest_recent(sizes)
    if largest is None or not rate:
        return None
    return upload_seconds(largest, rate)


def near_release(remaining: Optional[float], near_release_seconds: float,
                 next_upload: Optional[float]) -> bool:
    """Whether the release is near: within ``near_release_seconds``, or within twice the
    next upload's estimate (a large checkpoint on a slow link needs more than that)."""
    if remaining is None:
        return False
    return remaining < max(near_release_seconds, 2 * (next_upload or 0.0))


def gives_way(
    remaining: Optional[float],
    *,
    near_release_seconds: float,
    next_upload: Optional[float],
    current_left: float,
    newer: float,
    rate: Optional[float],
) -> bool:
    """Whether the upload in progress (``current_left`` still to send) stops for a newer
    checkpoint (``newer`` to send), the release being ``remaining`` seconds away.

    Far from the release the running upload always finishes first. Near it, the newer one
    goes first unless finishing this one and then uploading the newer one both end before
    the release, each at ``rate`` with the margin: the final checkpoint and the top-up save
    after it (``SavePolicy.top_up_seconds``, which budgets for this order) both count, and
    giving up a final upload that is nearly done for a top-up would risk both; and never
    for a newer one that would not end in time alone either (a link that slowed: the
    running one is the better chance). Unknown rate: give way."""
    if remaining is None or not near_release(remaining, near_release_seconds, next_upload):
        return False
    if not rate:
        return True
    newer_seconds = upload_seconds(newer, rate)
    if upload_seconds(current_left, rate) + newer_seconds <= remaining:
        return False
    return newer_seconds <= remaining
