"""The upload plan: the next upload's estimate, and which upload goes first near the release.

Pure (issue 21, item 4): plain numbers in, plain numbers out; no I/O, no clock, no settings,
standard library only. The daemon's uploader (``status``, ``uploader``) and the simulator
(``sidecar.tools.simulate.engine``) both decide with these functions, so the figures the
simulator prints are the rule the daemon runs. How near is near is a setting
(``--upload-near-release``, its default in ``sidecar.host.settings``), passed in: the
settings module must not load this package when upload is off.

Amounts and rates come in any one unit: the daemon counts bytes and bytes per second; the
simulator counts seconds at rate 1 (an amount is then its own duration).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Optional

__all__ = [
    "ESTIMATE_MARGIN",
    "RATE_WINDOW",
    "SIZE_WINDOW",
    "gives_way",
    "largest_recent",
    "near_release",
    "next_upload_seconds",
    "throughput",
    "upload_seconds",
]

# The estimate: the largest of the newest SIZE_WINDOW checkpoints over the throughput of the
# last RATE_WINDOW uploads, times ESTIMATE_MARGIN (as SavePolicy's margin on measured saves:
# normal variation, and the fixed cost of a small checkpoint).
SIZE_WINDOW = 3
RATE_WINDOW = 5
ESTIMATE_MARGIN = 1.2


def throughput(measured: Iterable[tuple[float, float]], cap: Optional[float]) -> Optional[float]:
    """Amount per second over the ``(amount, seconds)`` of the recent uploads, at most
    ``cap``; the cap itself before any was measured (None: no cap, nothing measured)."""
    uploads = list(measured)
    if not uploads:
        return None if cap is None else float(cap)
    rate = sum(amount for amount, _ in uploads) / sum(seconds for _, seconds in uploads)
    return rate if cap is None else min(rate, cap)


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
    giving up a final upload that is nearly done for a top-up would risk both. Unknown
    rate: give way."""
    if remaining is None or not near_release(remaining, near_release_seconds, next_upload):
        return False
    if not rate:
        return True
    return upload_seconds(current_left, rate) + upload_seconds(newer, rate) > remaining
