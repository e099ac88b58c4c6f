"""The one deadline merge (sidecar.train.deadlines): pure, no clock, no I/O."""

from __future__ import annotations

import pytest

from sidecar.train.deadlines import (
    DRILL,
    MACHINE,
    PROCESS,
    Candidate,
    daemon_kind,
    earliest,
    kind_of,
)


def test_the_earliest_wins_whatever_its_kind_or_place() -> None:
    daemon = Candidate(100.0, "daemon", MACHINE)
    slurm = Candidate(90.0, "slurm", PROCESS)
    drill = Candidate(80.0, "drill", DRILL)
    assert earliest([daemon, slurm]) is slurm
    assert earliest([slurm, daemon]) is slurm
    assert earliest([daemon, slurm, drill]) is drill
    assert earliest([None, daemon, None]) is daemon


def test_nothing_known_is_none() -> None:
    assert earliest([]) is None
    assert earliest([None, None]) is None
    assert earliest(iter(())) is None


def test_on_a_tie_the_first_listed_real_deadline_stays() -> None:
    daemon = Candidate(100.0, "daemon", MACHINE)
    sigterm = Candidate(100.0, "sigterm", PROCESS)
    env = Candidate(100.0, "env", PROCESS)
    assert earliest([daemon, sigterm]) is daemon
    assert earliest([sigterm, daemon]) is sigterm
    assert earliest([env, daemon, sigterm]) is env


def test_on_a_tie_a_drill_never_hides_the_real_deadline() -> None:
    drill = Candidate(100.0, "drill", DRILL)
    real = Candidate(100.0, "daemon", MACHINE)
    assert earliest([drill, real]) is real
    assert earliest([real, drill]) is real
    # Between two drills, the first listed.
    other = Candidate(100.0, "drill-2", DRILL)
    assert earliest([drill, other]) is drill
    # A drill strictly earlier still wins.
    assert earliest([real, Candidate(99.9, "drill", DRILL)]).kind == DRILL  # type: ignore[union-attr]


def test_a_kind_is_one_of_three() -> None:
    with pytest.raises(ValueError, match="deadline kind"):
        Candidate(1.0, "daemon", "reclaim")  # type: ignore[arg-type]
    assert [kind_of(k) for k in ("machine", "process", "drill", "spot", None, 1)] == [
        MACHINE, PROCESS, DRILL, None, None, None]


def test_the_daemon_s_served_kind_wins_over_its_source_s_name() -> None:
    assert daemon_kind("machine", "slurm") == MACHINE
    assert daemon_kind("process", "volcengine-esi") == PROCESS
    # An older daemon serves none (or something this side does not know): the name's guess.
    for served in (None, "something-new", DRILL):
        assert daemon_kind(served, "slurm") == PROCESS
        assert daemon_kind(served, "env") == PROCESS
        assert daemon_kind(served, "volcengine-esi") == MACHINE
        assert daemon_kind(served, None) == MACHINE
