"""The release account's rule (sidecar.train.reclaim_cost): pure, and the simulator's."""

from __future__ import annotations

import pytest

from sidecar.tools.simulate.engine import simulate_run
from sidecar.tools.simulate.policies import get_policy
from sidecar.tools.simulate.workloads import get_workload
from sidecar.train.reclaim_cost import (
    ReleaseCost,
    effective_ratio,
    lost_seconds,
    redone_seconds,
    release_cost,
    state_of_manifest,
)


def test_lost_is_from_the_state_resumed_to_the_release() -> None:
    assert lost_seconds(1000.0, 400.0) == 600.0
    assert lost_seconds(1000.0, 1200.0) == 0.0


def test_redone_counts_only_training_after_the_state() -> None:
    steps = [(0.0, 10.0), (10.0, 20.0), (25.0, 35.0)]
    assert redone_seconds(steps, 15.0) == 5.0 + 10.0


def test_an_account_round_trips_through_json() -> None:
    cost = release_cost(released_unix=2000.0, state_unix=1900.0, resumed_step=7,
                        trained=[(1950.0, 1990.0)], idle_seconds=10.0, saves=3,
                        started_unix=1000.0, job="a:1")
    assert (cost.lost_seconds, cost.redone_seconds, cost.idle_seconds) == (100.0, 40.0, 10.0)
    assert ReleaseCost.from_json(cost.to_json()) == cost
    with pytest.raises(ValueError, match="saves"):
        ReleaseCost.from_json({**cost.to_json(), "saves": -1})


def test_the_effective_ratio_is_surviving_time_over_wall_time() -> None:
    one = release_cost(released_unix=1000.0, state_unix=900.0, resumed_step=1, started_unix=0.0)
    two = release_cost(released_unix=3000.0, state_unix=2500.0, resumed_step=2,
                       started_unix=2000.0)
    assert effective_ratio([one, two]) == pytest.approx((900 + 500) / (1000 + 1000))
    assert effective_ratio([release_cost(released_unix=1.0, state_unix=0.0,
                                         resumed_step=None)]) is None


def test_the_state_is_when_the_save_began_else_when_it_was_made() -> None:
    assert state_of_manifest({"step": 3, "started_at": "2030-01-01T00:00:00Z",
                              "created_at": "2030-01-01T00:01:00Z"}) == (1893456000.0, 3)
    assert state_of_manifest({"created_at": "2030-01-01T00:01:00Z"})[0] == 1893456060.0
    with pytest.raises(ValueError):
        state_of_manifest({"step": 1})


def test_the_simulator_accounts_with_the_same_rule() -> None:
    outcome = simulate_run(get_workload("steady"), get_policy("sidecar"), seed=3)
    assert outcome.lost_seconds >= outcome.unsaved_seconds >= 0
