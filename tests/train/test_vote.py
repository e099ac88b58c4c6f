"""The vote: one table of fields (MIN or MAX, the "unknown" value), packing and the
per-slot operations read from it, and the old seven-float reducer still accepted."""

from __future__ import annotations

import math
import socket
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import pytest

from sidecar.train.client import SidecarClient
from sidecar.train.guard import (
    UNKNOWN_AFTER_FINAL,
    UNKNOWN_COVERED,
    UNKNOWN_REMAINING,
    UNKNOWN_SAVE,
    UNKNOWN_STEP,
    UNKNOWN_UPLOAD,
    CheckpointGuard,
)
from sidecar.train.policy import SavePolicy
from sidecar.train.vote import (
    MAX,
    MIN,
    UNKNOWN_AT_RISK,
    UNKNOWN_PROCESS,
    UNKNOWN_ROUTINE,
    Op,
    Vote,
    as_reducer,
    vote_field,
)

MLP = "MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP"


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def all_reduce(ranks: Sequence[Sequence[float]], ops: Sequence[Op]) -> list[float]:
    """What every rank's reducer returns: each slot combined with its own operation."""
    return [min(column) if op == MIN else max(column) for op, column in zip(ops, zip(*ranks))]


def test_the_table_is_the_dataclass_in_wire_order() -> None:
    table = [(row.name, row.op, row.unknown) for row in Vote.table()]
    assert table == [
        ("remaining_seconds", MIN, UNKNOWN_REMAINING),
        ("step_seconds", MAX, UNKNOWN_STEP),
        ("save_seconds", MAX, UNKNOWN_SAVE),
        ("covered_seconds", MAX, UNKNOWN_COVERED),
        ("upload_seconds", MAX, UNKNOWN_UPLOAD),
        ("steps_after_final", MIN, UNKNOWN_AFTER_FINAL),
        ("typical_step_seconds", MAX, UNKNOWN_STEP),
        ("drill_seconds", MIN, UNKNOWN_REMAINING),
        ("routine_overdue_seconds", MAX, UNKNOWN_ROUTINE),
        ("at_risk_seconds", MIN, UNKNOWN_AT_RISK),
        ("process_deadline", MAX, UNKNOWN_PROCESS),
    ]
    assert Vote.ops() == [op for _name, op, _unknown in table]


def test_unknown_travels_as_a_value_that_loses_and_comes_back_as_none() -> None:
    knows_nothing = Vote()
    assert knows_nothing.pack() == [row.unknown for row in Vote.table()]
    assert Vote.unpack(knows_nothing.pack()) == knows_nothing
    knows = Vote(remaining_seconds=-3.0, step_seconds=0.0, save_seconds=61.0,
                 covered_seconds=-2.0, upload_seconds=12.5, steps_after_final=-1.0,
                 typical_step_seconds=3.0)
    assert Vote.unpack(knows.pack()) == knows
    # Any rank that knows wins the reduction; a slot no rank knew is unknown again.
    reduced = Vote.unpack(all_reduce([knows_nothing.pack(), Vote(step_seconds=2.0).pack()],
                                     Vote.ops()))
    assert reduced == Vote(step_seconds=2.0)
    # Nothing a reducer returns that is not a number on the winning side is taken as known.
    garbage = [math.nan, math.inf, -math.inf, math.inf, math.nan, math.nan, UNKNOWN_STEP,
               math.nan, math.inf, math.nan, -math.inf]
    assert Vote.unpack(garbage) == Vote()
    with pytest.raises(ValueError, match="returned 6 numbers, not 11"):
        Vote.unpack([0.0] * 6)


@dataclass(frozen=True)
class WiderVote(Vote):
    """A vote with one more number: the one line below is all it takes."""

    queue_seconds: Optional[float] = vote_field(MAX, -1.0)


def test_adding_a_field_is_one_line() -> None:
    assert [row.name for row in WiderVote.table()][-1] == "queue_seconds"
    assert WiderVote.ops() == [*Vote.ops(), MAX]
    ranks = [WiderVote(remaining_seconds=50.0), WiderVote(queue_seconds=4.0, step_seconds=1.0)]

    def reducer(values: Sequence[float], ops: Sequence[Op], /) -> list[float]:
        assert len(values) == len(ops) == 12
        return all_reduce([rank.pack() for rank in ranks], ops)

    assert ranks[0].reduced(reducer) == WiderVote(remaining_seconds=50.0, step_seconds=1.0,
                                                  queue_seconds=4.0)


def test_a_list_reducer_needs_no_warning_and_decides_on_the_reduced_vote() -> None:
    seen: list[tuple[list[float], list[str]]] = []

    def peer_knows_a_deadline(values: Sequence[float], ops: Sequence[Op], /) -> list[float]:
        seen.append((list(values), list(ops)))
        peer = Vote(remaining_seconds=140.0, step_seconds=20.0, save_seconds=5.0)
        return all_reduce([values, peer.pack()], ops)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        guard = CheckpointGuard(SidecarClient(f"http://127.0.0.1:{closed_port()}"),
                                environ={}, reducer=peer_knows_a_deadline, events=False)
    assert guard.should_save() is True
    # This rank knows nothing but that it trained nothing yet.
    assert seen == [(Vote(at_risk_seconds=0.0).pack(), Vote.ops())]
    decision = guard.last_decision
    assert decision is not None and decision.remaining_seconds == 140.0
    assert decision.budget_seconds == pytest.approx(20 + 5 + 120)


def test_a_seven_float_reducer_still_works_with_a_deprecation_warning() -> None:
    calls: list[tuple[float, ...]] = []

    def old_style(
        remaining: float, step: float, save: float, covered: float, upload: float,
        after_final: float, typical: float,
    ) -> tuple[float, float, float, float, float, float, float]:
        calls.append((remaining, step, save, covered, upload, after_final, typical))
        return remaining, step, save, covered, upload, after_final, typical

    environ = {MLP: str(time.time() + 100)}
    with pytest.warns(DeprecationWarning, match="seven positional floats is deprecated"):
        guard = CheckpointGuard(SidecarClient(f"http://127.0.0.1:{closed_port()}"),
                                SavePolicy(save_seconds=10.0, top_up_seconds=None), environ=environ,
                                reducer=old_style, events=False, wait_for_release=False)
    guard.record_step(1.0)
    assert guard.should_save() is True  # 100 s left <= 1 s step + 10 s save + 120 s margin
    assert len(calls) == 1 and calls[0][1:] == (1.0, UNKNOWN_SAVE, UNKNOWN_COVERED,
                                                UNKNOWN_UPLOAD, UNKNOWN_AFTER_FINAL, 1.0)
    assert calls[0][0] == pytest.approx(100.0, abs=5.0)
    with guard.saving(step=1):
        pass
    assert guard.should_stop() is True
    assert len(calls) == 2


def test_a_seven_float_reducer_cannot_reduce_a_wider_vote() -> None:
    with pytest.warns(DeprecationWarning):
        adapted = as_reducer(lambda a, b, c, d, e, f, g: (a, b, c, d, e, f, g))
    assert list(adapted(Vote().pack(), Vote.ops())) == Vote().pack()
    with pytest.raises(TypeError, match="cannot reduce a vote of 12 numbers"):
        WiderVote().reduced(adapted)
