"""The upload plan: the next upload's estimate, and which upload goes first near the release.

Pure (issue 21, item 4): plain numbers in, plain numbers out; no I/O, no clock, no settings,
standard library only. The daemon's uploader (``status``, ``uploader``) and the simulator
(``sidecar.tools.simulate.uploads``) both decide with these functions, so the figures the
simulator prints are the rule the daemon runs. How near is near is a setting
(``--upload-near-release``), passed in; the upload settings' defaults live here, below the
settings table that names them (``sidecar.host.settings``), so no arrow runs from the
upload package back up to the settings. Loading this module loads nothing else: the
daemon without upload reads these defaults and never loads boto3 or the uploader.

Amounts and rates come in any one unit: the daemon counts bytes and bytes per second; the
simulator counts seconds at rate 1 (an amount is then its own duration).

The rate is the slow tail, not the mean (issue 23, item 3): a mean x 1.2 is beaten by one
slow upload in four when upload times are lognormal (sigma 0.35), and missed 5 of 200
releases on the simulator's ``upload-lognormal``. The p90 of seconds per unit over the last
10 uploads (nearest rank: the slowest below ten, the second slowest at ten) missed none
there, losing 447 s (median) against 459 s for the slowest of 5 and 481 s for p95 over 20;
p80 over 10 missed one. An upload in progress that is slower than that counts at once
(:func:`in_progress_rate`), so a link that slows is seen before the upload ends.

A link that slows while nothing uploads is seen by a probe (:func:`probe_interval`,
:func:`probe_amount`, :func:`with_probe`): a few seconds' worth of bytes at the rate the
estimate assumes, sent nowhere visible, every ``PROBE_FAR_SECONDS`` and every
``PROBE_NEAR_SECONDS`` near the release; a probe newer than the last upload that is slower
than the estimate's rate counts at once. On the simulator's ``link-halves`` (the link's
speed halves 2-20 min before the release, while nothing uploads) that took the misses
from 115 of 200 to the ones whose link halved after the final save began (see
docs/simulation.md).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Optional

__all__ = [
    "DEFAULT_UPLOAD_CONCURRENCY",
    "DEFAULT_UPLOAD_NEAR_RELEASE_SECONDS",
    "DEFAULT_UPLOAD_PART_SIZE",
    "DEFAULT_UPLOAD_SCAN_INTERVAL_SECONDS",
    "ESTIMATE_MARGIN",
    "PROBES_TO_AGREE",
    "PROBE_FAR_SECONDS",
    "PROBE_NEAR_SECONDS",
    "PROBE_SECONDS",
    "RATE_WINDOW",
    "SIZE_WINDOW",
    "SLOW_QUANTILE",
    "estimate_seconds",
    "gives_way",
    "in_progress_rate",
    "largest_recent",
    "near_release",
    "next_upload_seconds",
    "probe_amount",
    "probe_interval",
    "probed_rate",
    "throughput",
    "upload_seconds",
    "with_probe",
]

# The upload settings' defaults (their rows: sidecar.host.settings; docs/deploy.md).
DEFAULT_UPLOAD_CONCURRENCY = 8  # parts of one file in flight (S3)
DEFAULT_UPLOAD_PART_SIZE = 64 << 20  # bytes per multipart part (S3)
DEFAULT_UPLOAD_NEAR_RELEASE_SECONDS = 600.0  # near: the newest checkpoint goes first
DEFAULT_UPLOAD_SCAN_INTERVAL_SECONDS = 5.0  # the checkpoint folder listed at least this often

# The estimate: the largest of the newest SIZE_WINDOW checkpoints over the slow tail of the
# last RATE_WINDOW uploads' rates (the SLOW_QUANTILE of their seconds per unit sent), times
# ESTIMATE_MARGIN (as SavePolicy's margin on measured saves: normal variation, and the fixed
# cost of a small checkpoint).
SIZE_WINDOW = 3
RATE_WINDOW = 10
SLOW_QUANTILE = 0.9
ESTIMATE_MARGIN = 1.2

# The probe: PROBE_SECONDS of sending at the assumed rate (long enough that a request's
# fixed cost is a small part of it), every PROBE_FAR_SECONDS while the uploader is idle,
# every PROBE_NEAR_SECONDS once the release is near (where the final save is decided).
PROBE_SECONDS = 2.0
PROBE_FAR_SECONDS = 600.0
PROBE_NEAR_SECONDS = 30.0
PROBES_TO_AGREE = 2


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


def probe_interval(remaining: Optional[float], near_release_seconds: float,
                   next_upload: Optional[float]) -> float:
    """How long after the last measurement (a probe, or an upload's end) the next probe is
    due: ``PROBE_NEAR_SECONDS`` when the release is near (:func:`near_release`),
    ``PROBE_FAR_SECONDS`` otherwise (no deadline known included: a notice may come)."""
    if near_release(remaining, near_release_seconds, next_upload):
        return PROBE_NEAR_SECONDS
    return PROBE_FAR_SECONDS


def probe_amount(rate: float) -> float:
    """What a probe sends: ``PROBE_SECONDS`` worth at ``rate`` (the caller bounds it)."""
    return rate * PROBE_SECONDS


def probed_rate(rates: Sequence[float]) -> Optional[float]:
    """The link's rate by the probes since the last upload (``rates``: oldest first): the
    faster of the newest ``PROBES_TO_AGREE``, so that one slow probe on a noisy link
    does not move the estimate and a link that did slow is seen by the next probe too.
    None with fewer."""
    newest = [rate for rate in rates[-PROBES_TO_AGREE:] if rate > 0]
    return max(newest) if len(newest) == PROBES_TO_AGREE else None


def with_probe(rate: Optional[float], probe_rate: Optional[float]) -> Optional[float]:
    """``rate``, or slower when a probe shows a slower link: the probe's rate times
    ``ESTIMATE_MARGIN``, so that the estimate (which divides by the rate and multiplies by
    the margin) is then the probed duration itself, and a probe no slower than the margin
    already covers changes nothing (a noisy link's one slow probe). The caller passes a
    probe only when it is newer than the last upload (an upload measures the link better
    than a probe)."""
    if not probe_rate or probe_rate <= 0:
        return rate
    probed = probe_rate * ESTIMATE_MARGIN
    return probed if not rate else min(rate, probed)


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


def estimate_seconds(sizes: Sequence[float], rate: Optional[float],
                     durations: Sequence[Optional[float]]) -> Optional[float]:
    """What the daemon serves as the next upload's duration (``upload_seconds``):
    :func:`next_upload_seconds`, never less than the newest ``SIZE_WINDOW`` checkpoints'
    measured times from their commit's start to durable (``durations``: newest first,
    None where none was measured) x ``ESTIMATE_MARGIN``: a commit that sends nothing
    after its save (all of it streamed) still fsyncs, renames and writes its manifest."""
    estimate = next_upload_seconds(sizes, rate)
    if estimate is None:
        return None
    measured = [seconds for seconds in durations[:SIZE_WINDOW] if seconds is not None]
    return max([estimate, *(seconds * ESTIMATE_MARGIN for seconds in measured)])


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
