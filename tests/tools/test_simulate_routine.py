"""The simulator's routine saves: the stand-in client serves the workload's notice as the
daemon's GET /v1/protection does, so the real guard's routine saves engage where no notice
holds a save, and nowhere else (issue 23, item 6)."""

from __future__ import annotations

from dataclasses import replace

from sidecar.tools.simulate.engine import run, simulate_run
from sidecar.tools.simulate.policies import POLICIES, RunInfo, SidecarPolicy
from sidecar.tools.simulate.workloads import HEAVY_WORKLOADS, WORKLOADS

ROUTINE = ["gcp-notice-30s-heavy", "spot-notice-120s-heavy"]


def test_the_stand_in_client_serves_the_workloads_notice_or_none() -> None:
    gcp = HEAVY_WORKLOADS["gcp-notice-30s-heavy"]
    agent = POLICIES["sidecar"].make(RunInfo(gcp.trace(0), 1000.0))
    assert isinstance(agent, SidecarPolicy)
    assert agent.policy.routine_seconds == "auto"  # the default
    assert agent._known.source_notices() is None  # nothing declared yet
    agent.source_notice(gcp.notice)
    assert agent._known.source_notices() == {"gcp": 30.0}
    assert HEAVY_WORKLOADS["spot-notice-120s-heavy"].notice == ("aws", 120.0)
    # The reference workloads declare none: their tables stay as they were.
    assert all(w.notice is None for w in WORKLOADS.values())
    off = POLICIES["sidecar-no-routine"].make(RunInfo(gcp.trace(0), 1000.0))
    assert isinstance(off, SidecarPolicy) and off.policy.routine_seconds is None


def test_routine_saves_bound_the_loss_where_no_notice_holds_a_save() -> None:
    results = run(ROUTINE, ["sidecar", "sidecar-no-routine", "oracle"], seeds=10)
    by = {(r.workload, r.policy): r for r in results}
    for name in ROUTINE:
        routine, off = by[(name, "sidecar")], by[(name, "sidecar-no-routine")]
        assert routine.feasible_runs == 0  # no notice holds step + save (+ upload)
        assert off.saves_mean == 0.0  # the final save never fits: all since the start lost
        assert routine.saves_mean >= 1.0
        assert routine.lost_median_seconds < off.lost_median_seconds / 3
        assert by[(name, "oracle")].lost_median_seconds < routine.lost_median_seconds


def test_a_notice_that_holds_the_save_gets_no_routine_saves() -> None:
    # A 5 min notice holds step + save: declared or not, the same run (the same draws).
    held = replace(WORKLOADS["spot-notice-300s"], notice=("volcengine-spot", 300.0))
    for seed in range(5):
        with_notice = simulate_run(held, POLICIES["sidecar"], seed)
        without = simulate_run(WORKLOADS["spot-notice-300s"], POLICIES["sidecar"], seed)
        assert (with_notice.saves, with_notice.lost_seconds) == (without.saves,
                                                                 without.lost_seconds)
