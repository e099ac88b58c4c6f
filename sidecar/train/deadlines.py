"""One deadline merge (issue 37, item 2). Pure: standard library only, no clock, no I/O.

Every deadline the training side knows is a :class:`Candidate`: when (Unix seconds),
where it came from (``"daemon"``, ``"env"``, ``"slurm"``, ``"sigterm"``, ``"drill"``, or a
daemon's URL) and whose end it is, its *kind*:

- ``"machine"``: the machine goes (a release or a reclaim notice the daemon serves);
- ``"process"``: only this process ends (a SIGTERM grace, a Slurm time limit, the
  environment's deadline);
- ``"drill"``: a rehearsal (``esi-sidecar drill``); it stands for the real deadline.

:func:`earliest` is the one merge: the client's across daemons, the tracker's of the
daemon and the environment, ``with_slurm``, ``DrillFollower.earlier`` and
``with_sigterm`` all go through it.

Tie rule: of candidates with the same time, a real deadline (machine or process) wins
over a drill (a drill never hides the deadline it rehearses), and among the rest the one
listed first wins. Callers list the deadline they already hold first, so a new one
replaces it only when strictly earlier.

The daemon serves each deadline's kind (``deadline_kind`` in ``/v1/expiry`` and in each
of its ``notices``). :func:`daemon_kind` is the one place that guesses it from the
daemon's source name, and only for a daemon from before that field.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal, Optional

__all__ = [
    "DRILL",
    "KINDS",
    "MACHINE",
    "PROCESS",
    "PROCESS_SOURCES",
    "Candidate",
    "Kind",
    "daemon_kind",
    "earliest",
    "kind_of",
]

Kind = Literal["machine", "process", "drill"]
MACHINE: Kind = "machine"
PROCESS: Kind = "process"
DRILL: Kind = "drill"
KINDS: tuple[Kind, ...] = (MACHINE, PROCESS, DRILL)

# An older daemon's sources whose deadline ends the process, not the machine (a Slurm time
# limit; a deadline the host's environment gives): read by daemon_kind's guess only.
PROCESS_SOURCES = frozenset({"slurm", "env"})


@dataclass(frozen=True)
class Candidate:
    """One deadline: ``unix`` (seconds), its ``source`` and its ``kind``."""

    unix: float
    source: str
    kind: Kind

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"deadline kind must be one of {KINDS}, got {self.kind!r}")


def earliest(candidates: Iterable[Optional[Candidate]]) -> Optional[Candidate]:
    """The earliest of ``candidates`` (None entries skipped; None when none is left).

    Ties: a real deadline wins over a drill, then the first listed wins."""
    best: Optional[Candidate] = None
    for candidate in candidates:
        if candidate is None:
            continue
        if best is None or candidate.unix < best.unix or (
                candidate.unix == best.unix and best.kind == DRILL != candidate.kind):
            best = candidate
    return best


def kind_of(value: object) -> Optional[Kind]:
    """``value`` as a kind when it is one (a served field), else None."""
    for kind in KINDS:
        if value == kind:
            return kind
    return None


def daemon_kind(served: object, daemon_source: Optional[str]) -> Kind:
    """The kind of the deadline a daemon gave: the one it served (``deadline_kind``);
    for an older daemon that serves none, guessed from its source's name (a process's
    for ``PROCESS_SOURCES``, else the machine's). The only guess from a name."""
    kind = kind_of(served)
    if kind is not None and kind != DRILL:
        return kind
    return PROCESS if daemon_source in PROCESS_SOURCES else MACHINE
