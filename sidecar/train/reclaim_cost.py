"""What a release or reclaim cost in GPU time: the account, pure (no clock, no I/O).

Standard library only, one implementation: the simulator accounts its runs with it
(``sidecar.tools.simulate.engine``), the daemon its job's releases from the job events
(``sidecar.host.features.reclaims.ledger``), and ``esi-sidecar restore`` closes the account of the
previous machine from the checkpoint it restored (issue 24, item 3). The definitions are
the simulator's (docs/simulation.md):

- *lost*: the GPU time from the training state the next machine resumes from (the start
  of the restored checkpoint's save) to the release: steps to redo, saves, idling;
- of it *redone*: the training time after that state (steps to do again);
- of it *idle*: neither training nor saving (waiting for the release after the final save);
- the *effective-training-time ratio*: training time on state that survives, over the wall
  time, across every machine the job ran on, the time to resume included;
- the *time to resume* (issue 40, item 3), closed on the next machine: from the release to
  the job's first step after the restore, split into waiting for a machine (to the start
  of the restore), the restore, and the job's own start-up until its first step.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, Optional

from sidecar.timeparse import parse_timestamp

__all__ = ["ReleaseCost", "effective_ratio", "lost_seconds", "redone_seconds",
           "release_cost", "state_of_manifest", "with_resume"]


def lost_seconds(released_unix: float, state_unix: float) -> float:
    """GPU time from the state the next machine resumes from to the release."""
    return max(0.0, released_unix - state_unix)


def redone_seconds(trained: Iterable[tuple[float, float]], state_unix: float) -> float:
    """Training time after ``state_unix``: the steps to do again. ``trained``: the (start,
    end) of every step, the one cut by the release too."""
    return sum(max(0.0, end - max(start, state_unix)) for start, end in trained)


@dataclass(frozen=True)
class ReleaseCost:
    """One release's account. ``started_unix``: when the machine's job began (None: not
    known), for the wall time of the effective-training-time ratio."""

    released_unix: float
    state_unix: float  # the training state the next machine resumes from
    resumed_step: Optional[int]
    lost_seconds: float
    redone_seconds: float
    idle_seconds: float
    saves: int
    started_unix: Optional[float] = None
    job: Optional[str] = None
    closed_by: str = "daemon"  # "daemon" (from the job's events) or "restore"
    # The next machine (None until known): the restore's start and end, the first step.
    restore_started_unix: Optional[float] = None
    restore_finished_unix: Optional[float] = None
    resumed_unix: Optional[float] = None

    @property
    def resume_seconds(self) -> Optional[float]:
        """From the release to the job's first step on the next machine."""
        return None if self.resumed_unix is None else self.resumed_unix - self.released_unix

    def resume_split(self) -> Optional[dict[str, float]]:
        """waiting (for a machine), restore, startup (the job's own, to its first step)."""
        if self.resumed_unix is None or self.restore_started_unix is None \
                or self.restore_finished_unix is None:
            return None
        return {"waiting": self.restore_started_unix - self.released_unix,
                "restore": self.restore_finished_unix - self.restore_started_unix,
                "startup": self.resumed_unix - self.restore_finished_unix}

    @property
    def survived_seconds(self) -> Optional[float]:
        """Wall time of the machine's job that the next machine does not redo."""
        if self.started_unix is None:
            return None
        return max(0.0, self.state_unix - self.started_unix)

    @property
    def wall_seconds(self) -> Optional[float]:
        if self.started_unix is None:
            return None
        return max(0.0, self.released_unix - self.started_unix)

    def to_json(self) -> dict[str, Any]:
        split = self.resume_split() or {}
        return {**asdict(self), "resume_seconds": self.resume_seconds,
                "waiting_seconds": split.get("waiting"), "restore_seconds": split.get("restore"),
                "startup_seconds": split.get("startup")}

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> ReleaseCost:
        """The inverse of :meth:`to_json`; ValueError naming the first bad field."""
        def number(name: str, optional: bool = False) -> Optional[float]:
            value = body.get(name)
            if value is None and optional:
                return None
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                    value == value and abs(value) < 1e12):
                raise ValueError(f"{name}: not a number")
            return float(value)

        step = body.get("resumed_step")
        saves = body.get("saves")
        if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
            raise ValueError("resumed_step: not an integer")
        if isinstance(saves, bool) or not isinstance(saves, int) or saves < 0:
            raise ValueError("saves: not a count")
        job, closed_by = body.get("job"), body.get("closed_by", "daemon")
        if job is not None and not isinstance(job, str):
            raise ValueError("job: not a string")
        if closed_by not in ("daemon", "restore"):
            raise ValueError("closed_by: not daemon or restore")
        return cls(
            released_unix=number("released_unix") or 0.0, state_unix=number("state_unix") or 0.0,
            resumed_step=step, lost_seconds=number("lost_seconds") or 0.0,
            redone_seconds=number("redone_seconds") or 0.0,
            idle_seconds=number("idle_seconds") or 0.0, saves=saves,
            started_unix=number("started_unix", optional=True), job=job, closed_by=closed_by,
            restore_started_unix=number("restore_started_unix", optional=True),
            restore_finished_unix=number("restore_finished_unix", optional=True),
            resumed_unix=number("resumed_unix", optional=True))


def state_of_manifest(manifest: Mapping[str, Any]) -> tuple[float, Optional[int]]:
    """When a checkpoint's training state was taken, and its step, from its parsed
    MANIFEST.json: ``started_at`` (when the save began), else ``created_at`` (a checkpoint
    written before the manifest said when its save began: its save is then not counted).
    ValueError when neither is a time."""
    stamp = manifest.get("started_at") or manifest.get("created_at")
    if not isinstance(stamp, str):
        raise ValueError("the manifest says neither started_at nor created_at")
    step = manifest.get("step")
    return parse_timestamp(stamp).when.timestamp(), step if isinstance(step, int) else None


def release_cost(
    *,
    released_unix: float,
    state_unix: float,
    resumed_step: Optional[int],
    trained: Sequence[tuple[float, float]] = (),
    idle_seconds: float = 0.0,
    saves: int = 0,
    started_unix: Optional[float] = None,
    job: Optional[str] = None,
    closed_by: str = "daemon",
) -> ReleaseCost:
    """The account of one release, from its timeline."""
    return ReleaseCost(
        released_unix=released_unix, state_unix=state_unix, resumed_step=resumed_step,
        lost_seconds=lost_seconds(released_unix, state_unix),
        redone_seconds=redone_seconds(trained, state_unix), idle_seconds=idle_seconds,
        saves=saves, started_unix=started_unix, job=job, closed_by=closed_by)


def with_resume(cost: ReleaseCost, *, restore_started_unix: float,
                restore_finished_unix: float, resumed_unix: float) -> ReleaseCost:
    """``cost`` closed with the next machine's timeline, each instant no earlier than the
    one before it (a machine up before the release waited for nothing)."""
    started = max(cost.released_unix, restore_started_unix)
    finished = max(started, restore_finished_unix)
    return replace(cost, restore_started_unix=started, restore_finished_unix=finished,
                   resumed_unix=max(finished, resumed_unix))


def effective_ratio(costs: Iterable[ReleaseCost]) -> Optional[float]:
    """Training time on state that survives over wall time, across the releases whose
    start is known; None when none is. The time to resume, where known, is wall time
    no one trained."""
    survived = wall = 0.0
    for cost in costs:
        if cost.wall_seconds is not None and cost.survived_seconds is not None:
            survived += cost.survived_seconds
            wall += cost.wall_seconds + (cost.resume_seconds or 0.0)
    return None if wall <= 0 else survived / wall
