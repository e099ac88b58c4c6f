"""The vote: the numbers every rank agrees on before a decision, and when the ranks vote.

Standard library only. The numbers are one dataclass, :class:`Vote`, whose fields are its
one table: each says how ranks combine it (MIN or MAX) and what stands for "unknown" on
the wire (a value that loses that combination, so any rank that knows wins). Packing,
unpacking and the per-slot operations are read from that table, so adding a number is
one line there. A :class:`Reducer` is a plain element-wise MIN/MAX across ranks of a
list of floats. :class:`CollectiveVote` holds the reducer and the schedule that lets
every rank skip the collective while the deadline is far.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable, Literal, Optional, Protocol, TypeVar

from sidecar.train.policy import PolicyDecision

__all__ = [
    "MAX",
    "MIN",
    "CollectiveVote",
    "Op",
    "Reducer",
    "SevenFloatReducer",
    "Verdict",
    "Vote",
    "VoteField",
    "as_reducer",
    "vote_field",
]

Op = Literal["min", "max"]
MIN: Op = "min"
MAX: Op = "max"

# How "unknown" travels through the reduction: a value that loses it.
UNKNOWN_REMAINING = math.inf  # MIN: any rank that knows a deadline wins
UNKNOWN_STEP = -1.0  # MAX
UNKNOWN_SAVE = -1.0  # MAX: a save measured on any rank (often rank 0) wins
UNKNOWN_COVERED = -math.inf  # MAX: a save made on any rank covers everyone
UNKNOWN_UPLOAD = -1.0  # MAX: the slowest node's upload counts
UNKNOWN_AFTER_FINAL = math.inf  # MIN: the ranks that recorded the saves count
UNKNOWN_ROUTINE = -math.inf  # MAX: a routine save due on any rank is made on every rank
UNKNOWN_AT_RISK = math.inf  # MIN: the ranks that recorded the last save count
UNKNOWN_PROCESS = -1.0  # MAX: 1 on any rank (its deadline is the process's) wins over 0

# Scheduled reduction: when the deadline is far, the ranks agree at most this long (and
# this many decisions) apart instead of at every step.
MAX_SKIP_SECONDS = 5.0
MAX_SKIP_DECISIONS = 200

#: A decision and the absolute deadline it used (reduced across ranks).
Verdict = tuple[PolicyDecision, Optional[float]]

V = TypeVar("V", bound="Vote")
_TABLES: dict[type, tuple[VoteField, ...]] = {}


class Reducer(Protocol):
    """Makes every rank of a distributed job decide alike (``torch.distributed`` etc.).

    Called on every rank with this rank's numbers and one operation per number (``"min"``
    or ``"max"``, :data:`MIN` / :data:`MAX`), it returns as many numbers, each combined
    across all ranks with its operation: ``out[i] = op[i](values[i] of every rank)``. The
    numbers are :class:`Vote`'s fields in order; "unknown" arrives as a value that loses
    its operation (+inf under MIN, -1 or -inf under MAX). Use float64: remaining times
    are large.

    Collective: the guard calls it once per ``should_save()`` and once per
    ``should_stop()`` (and, while ``should_stop()`` waits for the release, once per
    ``refresh_seconds``) on every rank alike, except the decisions the schedule skips on
    every rank. Exceptions from it propagate: skipping a collective on one rank would hang
    the others.

    The old form, a function of seven positional floats returning seven, is still
    accepted for this release with a ``DeprecationWarning`` (see :func:`as_reducer`).
    """

    def __call__(self, values: Sequence[float], ops: Sequence[Op], /) -> Sequence[float]: ...


def vote_field(op: Op, unknown: float) -> Any:
    """One row of the vote's table: how ranks combine the number, what "unknown" is sent as."""
    return dataclasses.field(default=None, metadata={"op": op, "unknown": unknown})


@dataclass(frozen=True)
class VoteField:
    """One number of the vote, as the table declares it."""

    name: str
    op: Op
    unknown: float

    def known(self, value: float) -> Optional[float]:
        """A reduced value, or None when it is the unknown one: not finite, or not on the
        winning side of ``unknown`` (no rank knew it)."""
        value = float(value)
        if not math.isfinite(value):
            return None
        winning = value < self.unknown if self.op == MIN else value > self.unknown
        return value if winning else None


@dataclass(frozen=True)
class Vote:
    """The numbers the ranks agree on; None is "this rank does not know"."""

    remaining_seconds: Optional[float] = vote_field(MIN, UNKNOWN_REMAINING)
    step_seconds: Optional[float] = vote_field(MAX, UNKNOWN_STEP)
    save_seconds: Optional[float] = vote_field(MAX, UNKNOWN_SAVE)  # measured, not configured
    covered_seconds: Optional[float] = vote_field(MAX, UNKNOWN_COVERED)
    upload_seconds: Optional[float] = vote_field(MAX, UNKNOWN_UPLOAD)
    steps_after_final: Optional[float] = vote_field(MIN, UNKNOWN_AFTER_FINAL)  # -1: topped up
    typical_step_seconds: Optional[float] = vote_field(MAX, UNKNOWN_STEP)
    drill_seconds: Optional[float] = vote_field(MIN, UNKNOWN_REMAINING)  # a drill's (drill.py)
    # How far past due a routine save is (routine.py; negative: not yet).
    routine_overdue_seconds: Optional[float] = vote_field(MAX, UNKNOWN_ROUTINE)
    # Training since the last save (SavePolicy.at_risk_seconds; the fallback save's).
    at_risk_seconds: Optional[float] = vote_field(MIN, UNKNOWN_AT_RISK)
    # 1: this rank's deadline is the process's (SIGTERM, Slurm, environment), 0: the
    # machine's (the daemon's release or notice); try_late_saves="auto" reads it.
    process_deadline: Optional[float] = vote_field(MAX, UNKNOWN_PROCESS)

    @classmethod
    def table(cls) -> tuple[VoteField, ...]:
        """The fields in wire order, read from the dataclass declaration."""
        table = _TABLES.get(cls)
        if table is None:  # once per class: a decision packs at every step
            table = _TABLES[cls] = tuple(
                VoteField(f.name, f.metadata["op"], f.metadata["unknown"])
                for f in dataclasses.fields(cls))
        return table

    @classmethod
    def ops(cls) -> list[Op]:
        return [row.op for row in cls.table()]

    def pack(self) -> list[float]:
        """The numbers in wire order, "unknown" as its sentinel."""
        values = ((row, getattr(self, row.name)) for row in self.table())
        return [row.unknown if value is None else float(value) for row, value in values]

    @classmethod
    def unpack(cls: type[V], values: Sequence[float]) -> V:
        table = cls.table()
        if len(values) != len(table):
            raise ValueError(f"the reducer returned {len(values)} numbers, not {len(table)}")
        return cls(**{row.name: row.known(value) for row, value in zip(table, values)})

    def reduced(self: V, reducer: Reducer) -> V:
        """This rank's vote combined with every other rank's (collective)."""
        return self.unpack(list(reducer(self.pack(), self.ops())))


class SevenFloatReducer:
    """The old reducer protocol (seven positional floats), adapted to the list one.

    The numbers past the seventh (the drill's, the routine save's, the training at risk,
    whose deadline it is) cannot travel through it: a guard with such a reducer follows no
    drill, asks no routine or fallback save and starts no late save
    (``CollectiveVote.drills``), so those slots are always "unknown"."""

    def __init__(self, reducer: Callable[..., Sequence[float]]) -> None:
        self.reducer = reducer

    def __call__(self, values: Sequence[float], ops: Sequence[Op], /) -> Sequence[float]:
        table = Vote.table()
        unknown = len(values) == len(table) and all(
            value == row.unknown for value, row in zip(values[7:], table[7:]))
        if len(values) != 7 and not unknown:
            raise TypeError(f"a reducer of seven positional floats cannot reduce a vote of "
                            f"{len(values)} numbers: take (values, ops) instead")
        return [*self.reducer(*values[:7]), *values[7:]]


def as_reducer(reducer: Any) -> Reducer:
    """``reducer`` in the list protocol. One that takes seven positional floats (the
    protocol before this release) is adapted, with a ``DeprecationWarning``: it goes in
    the next release."""
    try:
        signature = inspect.signature(reducer)
    except (TypeError, ValueError):  # no signature to read (a builtin): the new protocol
        return reducer
    try:
        signature.bind(0.0, 0.0)
    except TypeError:
        try:
            signature.bind(*([0.0] * 7))
        except TypeError:
            return reducer  # neither: it raises its own error when called
        warnings.warn(
            "a reducer of seven positional floats is deprecated and will not be accepted in "
            "the next release: take (values, ops) and reduce element-wise "
            "(sidecar.train.vote.Reducer)",
            DeprecationWarning, stacklevel=4)
        return SevenFloatReducer(reducer)
    return reducer


class CollectiveVote:
    """When the ranks vote: the reducer, the count of votes, and the far verdict every
    rank reuses, without voting, for the same number of decisions.

    ``sigterm_grace``: a SIGTERM may come (``sigterm_grace_seconds``), so a skipped stretch
    lasts at most 1 s. Not thread-safe: the training loop's thread only.
    """

    def __init__(self, reducer: Optional[Any], *, sigterm_grace: bool = False) -> None:
        self._given = reducer
        self._reducer = None if reducer is None else as_reducer(reducer)
        self._sigterm_grace = sigterm_grace
        self._far: Optional[Verdict] = None
        self._skip = 0
        #: Collective decisions made, and those skipped because the deadline was far.
        self.reductions = 0
        self.reductions_skipped = 0

    @property
    def reducer(self) -> Optional[Any]:
        """The reducer as given (None for a single process)."""
        return self._given

    @property
    def collective(self) -> bool:
        return self._reducer is not None

    @property
    def drills(self) -> bool:
        """Whether a drill's deadline can travel between the ranks (not through a reducer
        of seven positional floats, which has no slot for it)."""
        return not isinstance(self._reducer, SevenFloatReducer)

    def reuse(self) -> Optional[Verdict]:
        """The far verdict, when this decision is one the schedule skips."""
        if self._skip > 0 and self._far is not None:
            # Every rank counts the same collective decisions and computed the same skip
            # from the same reduced numbers: all of them skip this one, none waits.
            self._skip -= 1
            self.reductions_skipped += 1
            return self._far
        return None

    def agree(self, vote: Vote) -> Vote:
        """This rank's vote reduced across the ranks (collective)."""
        assert self._reducer is not None
        self.reductions += 1
        return vote.reduced(self._reducer)

    def schedule(self, verdict: Verdict, *, hold: bool) -> None:
        """After a collective decision: how many of the next ones reuse it (none when
        ``hold``: a SIGTERM came, or the guard is stopping)."""
        self._skip = 0 if hold else self._reductions_to_skip(verdict[0])
        self._far = verdict if self._skip else None

    def _reductions_to_skip(self, decision: PolicyDecision) -> int:
        """How many of the next collective decisions may reuse this one, computed from
        reduced numbers only (so every rank gets the same count).

        Only a far verdict is reused: no save, no stop, a measured step, and the deadline
        (if any) more than the budget away. The skipped steps last at most half the slack
        and at most MAX_SKIP_SECONDS (1 s with a SIGTERM grace), judged on the slowest
        rank's step: a deadline that a node learns meanwhile (a spot notice) reaches the
        other ranks that much later, never after the slack is gone.
        """
        step = decision.step_seconds
        if decision.save_now or decision.stop or step is None or step <= 0:
            return 0
        slack = math.inf
        if decision.remaining_seconds is not None:
            if decision.budget_seconds is None:
                return 0
            slack = decision.remaining_seconds - decision.budget_seconds
        if slack <= 0:
            return 0
        window = min(1.0 if self._sigterm_grace else MAX_SKIP_SECONDS, slack / 2)
        # Two collective decisions per step: should_save() and should_stop().
        return min(MAX_SKIP_DECISIONS, 2 * int(window // step))
