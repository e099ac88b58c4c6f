"""What this rank knows, before any reduction: its deadline and its measurements, as the
:class:`~sidecar.train.vote.Vote` the guard decides on (alone, or reduced across ranks).

Standard library only. The deadline is the earliest of the daemon's (or the environment's:
:class:`~sidecar.train.deadline.DeadlineTracker`), the Slurm job's end, a SIGTERM's and a
fire drill's; the measurements are the rule's (``SavePolicy``) and the upload budget's.
"""

from __future__ import annotations

import logging
from typing import Optional

from sidecar.train.deadline import DeadlineTracker
from sidecar.train.deadlines import MACHINE, Candidate
from sidecar.train.decision_notes import DecisionNotes
from sidecar.train.drill import DrillFollower
from sidecar.train.policy import SavePolicy
from sidecar.train.protection import JobFigures
from sidecar.train.routine import RoutineSaves
from sidecar.train.sigterm import SigtermDeadline, with_sigterm
from sidecar.train.slurm_deadline import SlurmDeadline, with_slurm
from sidecar.train.upload_time import UploadTime
from sidecar.train.vote import CollectiveVote, Vote

__all__ = ["LocalVote"]

# The guard's own voice: these lines are the guard's, as users filter them.
logger = logging.getLogger("sidecar.train.guard")


class LocalVote:
    """This rank's vote, from the guard's collaborators (each read when asked)."""

    def __init__(self, tracker: DeadlineTracker, policy: SavePolicy, *, upload: UploadTime,
                 routine: RoutineSaves, notes: DecisionNotes, drill: DrillFollower,
                 vote: CollectiveVote, slurm: Optional[SlurmDeadline]) -> None:
        self._tracker = tracker
        self._policy = policy
        self._upload = upload
        self._routine = routine
        self._notes = notes
        self._drill = drill
        self._vote = vote
        self._slurm = slurm
        self._warned_internal = False

    def of(self, now_unix: float, sigterm: Optional[SigtermDeadline]) -> Vote:
        """What this rank knows at ``now_unix`` (``sigterm``: the guard's, if any)."""
        held: Optional[Candidate] = None
        try:
            held = self._tracker.candidate()
        except Exception:  # a bug of ours must not stop training
            if not self._warned_internal:
                logger.exception("sidecar client failed; deciding without a deadline")
                self._warned_internal = True
        # Every deadline merged by sidecar.train.deadlines.earliest; the real one's kind is
        # the daemon's as served (or guessed for an older daemon: deadlines.daemon_kind),
        # a process's for any other; a drill rehearses the kind of the real one.
        real = with_sigterm(sigterm, with_slurm(
            self._slurm, self._tracker.reachable, held, ask=True))
        chosen, drill = self._drill.earlier(real, now_unix)
        deadline = None if chosen is None else chosen.unix
        machine = real is not None and real.kind == MACHINE
        policy = self._policy
        return Vote(
            remaining_seconds=None if deadline is None else deadline - now_unix,
            step_seconds=policy.step_estimate(),
            save_seconds=policy.measured_save_estimate(),
            covered_seconds=policy.covered_seconds(now_unix),
            upload_seconds=self._upload.seconds(),
            # After a SIGTERM the vote carries "no top-up" (-1) to every rank (MIN); this
            # rank's own decision reads the SIGTERM itself (rule row SIGTERM_SAVED).
            steps_after_final=policy.steps_after_final()
            if sigterm is None or sigterm.deadline() is None else -1.0,
            typical_step_seconds=policy.typical_step_estimate(),
            drill_seconds=None if drill is None else drill - now_unix,
            routine_overdue_seconds=self._routine.overdue(now_unix, JobFigures(
                policy.step_estimate(), policy.save_estimate(), self._upload.seconds()),
                sigterm, self._notes.last_saved) if self._vote.drills else None,
            at_risk_seconds=policy.at_risk_seconds() if self._vote.drills else None,
            process_deadline=None if deadline is None or not self._vote.drills
            else 0.0 if machine else 1.0,
        )
