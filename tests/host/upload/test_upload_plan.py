"""The upload plan on plain numbers: the next upload's estimate and the give-way rule that
the daemon's uploader and the simulator share (``sidecar.host.upload.plan``)."""

from __future__ import annotations

import subprocess
import sys
from typing import Optional

import pytest

from sidecar.host.upload import plan
from sidecar.host.upload.plan import (
    ESTIMATE_MARGIN,
    gives_way,
    in_progress_rate,
    largest_recent,
    near_release,
    next_upload_seconds,
    throughput,
    upload_seconds,
)

MIB = 1 << 20


def test_the_constants_are_the_documented_ones() -> None:
    assert (plan.SIZE_WINDOW, plan.RATE_WINDOW, plan.SLOW_QUANTILE) == (3, 10, 0.9)
    assert ESTIMATE_MARGIN == 1.2


def test_throughput_is_the_slow_tail_of_the_recent_rates_capped() -> None:
    assert throughput([], None) is None  # nothing measured, no cap
    assert throughput([], 50 * MIB) == 50 * MIB  # the cap until an upload was measured
    # Fewer than ten uploads: the slowest one's rate, not the pooled (100 + 300) / 20 s.
    assert throughput([(100 * MIB, 10.0), (300 * MIB, 10.0)], None) == 10 * MIB
    assert throughput([(100 * MIB, 10.0), (300 * MIB, 10.0)], 5 * MIB) == 5 * MIB
    assert throughput(iter([(10.0, 2.0)]), 100.0) == 5.0  # any iterable, once
    # Ten uploads at 10..100 units/s: nearest rank 9 of 10 in seconds per unit, the
    # second slowest (20/s); one very slow upload among ten is the tail's one outlier.
    ten = [(float(rate), 1.0) for rate in range(10, 101, 10)]
    assert throughput(ten, None) == pytest.approx(20.0)
    assert throughput(ten[1:], None) == pytest.approx(20.0)  # nine: the slowest
    # Twenty: rank 18, the third slowest.
    twenty = [(float(rate), 1.0) for rate in range(1, 21)]
    assert throughput(twenty, None) == pytest.approx(3.0)
    # A mean x 1.2 is beaten by a slow upload; the tail is not: 4 at 10/s, 1 at 5/s.
    mixed = [(10.0, 1.0)] * 4 + [(10.0, 2.0)]
    assert throughput(mixed, None) == 5.0
    assert throughput([(0.0, 1.0), (10.0, 0.0)], 7.0) == 7.0  # nothing usable: the cap


def test_an_upload_in_progress_slower_than_assumed_slows_the_rate() -> None:
    # At the assumed 10/s, or faster, nothing changes.
    assert in_progress_rate(10.0, sent=50.0, elapsed_seconds=5.0, left=50.0) == 10.0
    assert in_progress_rate(10.0, sent=80.0, elapsed_seconds=5.0, left=20.0) == 10.0
    # Half the speed: 25 sent in 5 s, 75 left. It cannot end before 5 + 7.5 s: 100 / 12.5.
    assert in_progress_rate(10.0, sent=25.0, elapsed_seconds=5.0, left=75.0) == 8.0
    # Once nothing is left it is the upload's own rate; it starts at the assumed one.
    assert in_progress_rate(10.0, sent=50.0, elapsed_seconds=10.0, left=0.0) == 5.0
    # Nothing sent yet after 2 s of a 100 upload: 100 / (2 + 10), never 0.
    assert in_progress_rate(10.0, sent=0.0, elapsed_seconds=2.0, left=100.0) == pytest.approx(
        100 / 12)
    # No rate to compare with, no time yet, nothing to send: the rate as it was.
    assert in_progress_rate(None, sent=10.0, elapsed_seconds=5.0, left=10.0) is None
    assert in_progress_rate(10.0, sent=0.0, elapsed_seconds=0.0, left=10.0) == 10.0
    assert in_progress_rate(10.0, sent=0.0, elapsed_seconds=3.0, left=0.0) == 10.0
    # The simulator's units (an amount is its duration at rate 1): the same bound at rate 1,
    # and for an upload of one unit in all.
    assert in_progress_rate(1.0, sent=10.0, elapsed_seconds=20.0, left=10.0) == 20 / 30
    assert in_progress_rate(1.0, sent=0.5, elapsed_seconds=1.0, left=0.5) == 1 / 1.5
    # Under a second in: already a bound (a slow first request shows at once).
    assert in_progress_rate(10.0, sent=1.0, elapsed_seconds=0.5, left=100.0) == 101 / 10.5
    # A clock read out of order (elapsed below 0) is no measurement: the rate as it was.
    assert in_progress_rate(10.0, sent=5.0, elapsed_seconds=-1.0, left=10.0) == 10.0
    # No time yet and nothing left: the rate as it was (never a division by zero).
    assert in_progress_rate(10.0, sent=5.0, elapsed_seconds=0.0, left=0.0) == 10.0
    # Into the estimate: 300 MiB at the slowed 8 MiB/s, with the margin: 45 s, not 36 s.
    slowed = in_progress_rate(10 * MIB, sent=25 * MIB, elapsed_seconds=5.0, left=75 * MIB)
    assert next_upload_seconds([300 * MIB], slowed) == pytest.approx(45.0)


def test_the_estimate_is_the_largest_of_the_newest_three_with_the_margin() -> None:
    assert largest_recent([]) is None
    # Newest first: the fourth (the old 900) is out of the window.
    assert largest_recent([10.0, 30.0, 20.0, 900.0]) == 30.0
    assert next_upload_seconds([10.0, 30.0, 20.0, 900.0], 2.0) == pytest.approx(30 / 2 * 1.2)
    assert next_upload_seconds([], 2.0) is None  # no checkpoint seen
    assert next_upload_seconds([10.0], None) is None  # no rate known
    assert next_upload_seconds([10.0], 0.0) is None
    assert upload_seconds(100.0, 10.0) == pytest.approx(12.0)


def test_near_is_the_configured_time_or_twice_the_next_upload() -> None:
    assert not near_release(None, 600.0, None)  # no deadline: never near
    assert near_release(599.0, 600.0, None) and not near_release(600.0, 600.0, None)
    # A 500 s upload makes the release near from 1,000 s on.
    assert near_release(999.0, 600.0, 500.0) and not near_release(1000.0, 600.0, 500.0)


def _gives_way(remaining: Optional[float], *, left: float = 50.0, newer: float = 50.0,
               rate: Optional[float] = 1.0, next_upload: Optional[float] = 60.0) -> bool:
    return gives_way(remaining, near_release_seconds=600.0, next_upload=next_upload,
                     current_left=left, newer=newer, rate=rate)


def test_far_from_the_release_the_running_upload_finishes_first() -> None:
    assert not _gives_way(None)
    assert not _gives_way(5000.0, left=4000.0, newer=4000.0)  # would not fit, but far
    assert not _gives_way(600.0, rate=None)  # the boundary itself is not near


def test_near_the_release_both_go_when_both_fit_this_one_first() -> None:
    # 50 s left of the final checkpoint, then a 50 s top-up: 120 s with the margin.
    assert not _gives_way(121.0) and not _gives_way(120.0)  # ending at the release fits
    assert _gives_way(119.0)  # they do not both fit: the newer one goes first
    # In bytes: 100 MiB left + 200 MiB newer at 10 MiB/s = 36 s with the margin.
    assert not _gives_way(40.0, left=100 * MIB, newer=200 * MIB, rate=10 * MIB)
    assert _gives_way(30.0, left=100 * MIB, newer=200 * MIB, rate=10 * MIB)


def test_near_the_release_never_for_a_newer_one_that_would_not_end_either() -> None:
    # 50 s left (60 s with the margin) and a 200 s newer one (240 s), 100 s away: the
    # newer one cannot end in time alone, so the running one goes on (it might).
    assert not _gives_way(100.0, left=50.0, newer=200.0)
    # 20 s newer (24 s): it ends alone, both do not (84 s > 70 s): it goes first.
    assert _gives_way(70.0, left=50.0, newer=20.0)


def test_a_large_next_upload_brings_the_release_near_before_the_window() -> None:
    # 900 s away is outside the 600 s window, but within twice a 500 s next upload: near.
    # 500 s left (600 s) and 400 s newer (480 s) do not both fit; the newer one alone does.
    assert _gives_way(900.0, left=500.0, newer=400.0, next_upload=500.0)
    assert not _gives_way(900.0, left=500.0, newer=400.0, next_upload=60.0)  # far


def test_a_newer_one_that_ends_exactly_at_the_release_still_goes_first() -> None:
    # 50 s newer is 60 s with the margin, 60 s away; with 10 s left both do not fit.
    assert upload_seconds(50.0, 1.0) == 60.0
    assert _gives_way(60.0, left=10.0, newer=50.0)


def test_near_the_release_an_unknown_rate_gives_way() -> None:
    assert _gives_way(500.0, rate=None)
    assert _gives_way(500.0, rate=0.0)


def test_importing_the_plan_loads_no_third_party_module() -> None:
    code = ("import sys, sidecar.host.upload.plan; "
            "print(sorted(m for m in ('boto3', 'botocore', 'watchdog', 'fastapi', "
            "'prometheus_client', 'sidecar.host.settings', 'sidecar.host.upload.status') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]"


def test_probes_count_only_when_two_agree_and_beyond_the_margin() -> None:
    assert plan.probed_rate([50.0]) is None  # one probe alone does not move the estimate
    assert plan.probed_rate([50.0, 40.0]) == 50.0  # the faster of the newest two
    assert plan.probed_rate([10.0, 50.0, 40.0]) == 50.0
    assert plan.with_probe(100.0, None) == 100.0
    assert plan.with_probe(100.0, 90.0) == 100.0  # within the estimate's 1.2: no change
    assert plan.with_probe(100.0, 50.0) == 60.0  # the probed duration is the estimate
    assert plan.with_probe(None, 50.0) == 60.0
    assert plan.probe_interval(100.0, 600.0, 10.0) == plan.PROBE_NEAR_SECONDS
    assert plan.probe_interval(5000.0, 600.0, 10.0) == plan.PROBE_FAR_SECONDS
    assert plan.probe_interval(None, 600.0, None) == plan.PROBE_FAR_SECONDS
    assert plan.probe_interval(1000.0, 600.0, 600.0) == plan.PROBE_NEAR_SECONDS  # 2 x upload


def test_the_estimate_served_is_never_below_the_measured_commits() -> None:
    # All of it streamed (nothing left after the save): the commit's measured time x 1.2.
    assert plan.estimate_seconds([0.0, 0.0], 10.0, [2.0, None]) == pytest.approx(2.4)
    # Bytes left after the save: those at the rate x 1.2, when that is longer.
    assert plan.estimate_seconds([100.0, 0.0], 10.0, [None, 2.0]) == pytest.approx(12.0)
    # Only the newest SIZE_WINDOW commits count; none seen or no rate: None.
    old = [None] * plan.SIZE_WINDOW + [50.0]
    assert plan.estimate_seconds([0.0] * 4, 10.0, old) == 0.0
    assert plan.estimate_seconds([], 10.0, []) is None
    assert plan.estimate_seconds([10.0], None, [5.0]) is None


def test_edges_the_mutation_check_found() -> None:
    # An amount under one unit is an amount (the simulator's units: seconds at rate 1).
    assert plan.throughput([(0.5, 1.0)], None) == 0.5
    # No next upload known: only the near-release setting counts, however small.
    assert not plan.near_release(1.5, 1.0, None)
    assert plan.near_release(0.5, 1.0, None)
    # A probe that measured nothing (rate 0) is not one of the two that must agree; rates
    # under one unit per second are rates (the simulator's units).
    assert plan.probed_rate([0.0, 5.0]) is None
    assert plan.probed_rate([0.5, 0.8]) == 0.8
    assert plan.with_probe(10.0, 0.5) == 0.5 * plan.ESTIMATE_MARGIN
    # A probe sends PROBE_SECONDS of bytes at the rate it expects.
    assert plan.probe_amount(10.0) == 10.0 * plan.PROBE_SECONDS
