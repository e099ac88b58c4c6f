"""The training-loop guard: the save rule (``sidecar.train.policy``) fed by the deadline.

Standard library only, like the client: it must import in any training image.

Ten lines in a training loop::

    guard = CheckpointGuard()
    for batch in loader:
        with guard.step():
            train_step(batch)
        if guard.should_save():
            with guard.saving():
                save_checkpoint()
        if guard.should_stop():
            break

Nothing here raises into the training loop because the daemon is down, slow or talking
nonsense: the deadline comes from :class:`~sidecar.train.deadline.DeadlineTracker`, which keeps
the last known one, falls back to the platform's environment variables, logs one warning
and retries later. Exceptions from the user's own save function do propagate (a failed
save silently taken for a good one would be worse than a crash), and the save is then not
counted. The guard keeps the loop's API; its collaborators do one job each: this rank's
vote (``local_vote``) and the vote across ranks (``vote``), the upload budget
(``upload_time``), recording a save against the decision that asked for it
(``save_recorder``), following the final save until durable (``durability``), the wait
for the release (``release_wait``), the job's events (``job_events``), what it shows
(``guard_status``) and keeps in the checkpoint (``guard_state``).
"""

from __future__ import annotations

import atexit
import logging
import sys
import time
import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, suppress
from typing import Callable, Optional, TypeVar

from sidecar.train import guard_state
from sidecar.train.client import SidecarClient
from sidecar.train.deadline import DEFAULT_REFRESH_SECONDS, DEFAULT_RETRY_SECONDS, DeadlineTracker
from sidecar.train.decision_notes import DecisionNotes
from sidecar.train.drill import DrillFollower
from sidecar.train.durability import DurabilityFollower
from sidecar.train.guard_status import GuardStatus
from sidecar.train.job_events import JobEvents
from sidecar.train.local_vote import LocalVote
from sidecar.train.policy import PolicyDecision, SavePolicy
from sidecar.train.rank_log import RankPrefix
from sidecar.train.release_wait import EXIT_RELEASED, ReleaseWait
from sidecar.train.routine import RoutineSaves
from sidecar.train.rule import PROCESS_SOURCES
from sidecar.train.save_recorder import SaveRecorder
from sidecar.train.sigterm import SigtermDeadline, with_sigterm
from sidecar.train.slurm_deadline import SlurmDeadline, with_slurm
from sidecar.train.step_time import LoopTimer
from sidecar.train.upload_time import UploadTime
from sidecar.train.vote import (
    MAX_SKIP_SECONDS,
    UNKNOWN_AFTER_FINAL,
    UNKNOWN_COVERED,
    UNKNOWN_REMAINING,
    UNKNOWN_SAVE,
    UNKNOWN_STEP,
    UNKNOWN_UPLOAD,
    CollectiveVote,
    Reducer,
    Verdict,
)

__all__ = [
    "EXIT_RELEASED",
    "MAX_SKIP_SECONDS",
    "PROCESS_SOURCES",
    "UNKNOWN_AFTER_FINAL",
    "UNKNOWN_COVERED",
    "UNKNOWN_REMAINING",
    "UNKNOWN_SAVE",
    "UNKNOWN_STEP",
    "UNKNOWN_UPLOAD",
    "CheckpointGuard",
    "GuardStatus",
    "Reducer",
]

logger = logging.getLogger("sidecar.train.guard")
# One logger for the guard and its collaborators: each line says its rank (rank_log.py).
logger.addFilter(RankPrefix())

T = TypeVar("T")

# Its version: the simulator writes one (sidecar.tools.simulate.policies).
STATE_VERSION = guard_state.STATE_VERSION

# PROCESS_SOURCES (the daemon's sources whose deadline ends the process, not the machine)
# moved to sidecar.train.rule with the rule's other inputs; the name stays importable here.


class CheckpointGuard:
    """Policy + I/O: decides at every step whether to save now, and when to stop.

    - ``client``: a :class:`SidecarClient` (default: one built from ``ESI_SIDECAR_URL``).
    - ``policy``: a :class:`SavePolicy` (default: 60 s save, 120 s margin, max of the
      last 100 steps).
    - ``refresh_seconds``: ask the daemon at most this often (default 1 s). Between
      refreshes the cached absolute deadline is used and the remaining time recomputed
      from ``clock``, so a step costs two clock reads when no refresh is due.
    - ``daemon_retry_seconds``: after a failed request (to any of the daemons), wait this
      long before the next (default 5 s), so a hung daemon costs at most one ``timeout``
      per 5 s.
    - ``clock`` (wall, for deadlines) and ``monotonic`` (for durations and refresh
      timing): injectable for tests.
    - ``reducer``: see :class:`~sidecar.train.vote.Reducer`; None for a single process.
    - ``environ``: where to read the fallback deadline variables (default ``os.environ``,
      read once here).
    - ``sigterm_grace_seconds``: take SIGTERM as a deadline this many seconds after it
      came (GCP/Azure preemption, Kubernetes eviction, SLURM ``--signal``: a few seconds
      below the platform's grace). The next step saves; without a reducer
      ``should_stop()`` then returns True at once; across ranks they all leave at it.
      Opt-in; build the guard in the main thread (its handler replaces SIGTERM's).
    - ``events``: tell this node's daemon what happens, never waiting (docs/events.md).
      Default on; ``job`` names the job (default ``hostname:pid``), the rank is ``$RANK``.
    - In a Slurm job, while no daemon answers: the job's end (``slurm_deadline``).

    Where the deadline comes from: see :class:`DeadlineTracker`, which caches it; a fire
    drill's (:mod:`sidecar.train.drill`) is saved for, never stopped for. Not thread-safe:
    call it from the training loop's thread.
    """

    def __init__(
        self,
        client: Optional[SidecarClient] = None,
        policy: Optional[SavePolicy] = None,
        *,
        refresh_seconds: float = DEFAULT_REFRESH_SECONDS,
        daemon_retry_seconds: float = DEFAULT_RETRY_SECONDS,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        reducer: Optional[Reducer] = None,
        environ: Optional[Mapping[str, str]] = None,
        wait_for_release: bool = True,
        sleep: Callable[[float], None] = time.sleep,
        sigterm_grace_seconds: Optional[float] = None,
        events: bool = True,
        job: Optional[str] = None,
    ) -> None:
        self._tracker = DeadlineTracker(
            client if client is not None else SidecarClient(),
            refresh_seconds=refresh_seconds,
            daemon_retry_seconds=daemon_retry_seconds,
            clock=clock,
            monotonic=monotonic,
            environ=environ,
        )
        self.policy = policy if policy is not None else SavePolicy()
        self._clock = clock
        self._monotonic = monotonic
        self._loop = LoopTimer(monotonic)  # what step() records: the pass, not the span
        self.wait_for_release = wait_for_release
        self.released = False  # should_stop() returned True because the release came
        # should_stop() said leave (the release, a SIGTERM): exit_if_released() exits 75.
        self.stopped = False
        self._finished = False  # the "finished" event went out (finish())
        self.sigterm: Optional[SigtermDeadline] = None
        if sigterm_grace_seconds is not None:
            self.sigterm = SigtermDeadline(sigterm_grace_seconds, clock)
            self.sigterm.install()
        self._vote = CollectiveVote(reducer, sigterm_grace=self.sigterm is not None)
        self._slurm = SlurmDeadline.from_environ(environ, self._vote.collective, self.sigterm)
        self._upload = UploadTime(self._tracker)
        self._events = JobEvents(self.client, enabled=events, job=job, clock=clock,
                                 monotonic=monotonic)
        self._durability = DurabilityFollower(self._tracker, self._events, clock=clock,
                                              monotonic=monotonic)
        self._drill = DrillFollower(self._tracker, self._durability, self._events, clock,
                                    self._vote.drills)
        self._release = ReleaseWait(self._events, clock=clock, sleep=sleep,
                                    collective=self._vote.collective)
        # The verdict behind the last should_save()/should_stop() (reduced across ranks),
        # None until one of them ran; written by _agree() only.
        self._agreed: Optional[Verdict] = None
        self._stopping = False  # the last should_stop() said stop
        self._notes = DecisionNotes(logger, self._events)
        self._routine = RoutineSaves.asking(self._tracker, self.policy.routine_seconds, logger,
                                            monotonic)
        # The save asked for by should_save(), recorded (save_recorder.py); this rank's vote.
        self._saves = SaveRecorder(self.policy, routine=self._routine, notes=self._notes,
                                   loop=self._loop, events=self._events,
                                   durability=self._durability, drill=self._drill, clock=clock)
        self._local = LocalVote(self._tracker, self.policy, upload=self._upload,
                                routine=self._routine, notes=self._notes, drill=self._drill,
                                vote=self._vote, slurm=self._slurm)
        if events:  # a job that ends without a release says so (docs/events.md, finished)
            atexit.register(_finish_at_exit, weakref.ref(self))

    @property
    def client(self) -> SidecarClient:
        return self._tracker.client

    @property
    def refresh_seconds(self) -> float:
        return self._tracker.refresh_seconds

    @property
    def daemon_retry_seconds(self) -> float:
        return self._tracker.daemon_retry_seconds

    @property
    def last_error(self) -> Optional[str]:
        """Why the last request to the daemon(s) failed, else None."""
        return self._tracker.last_error

    @property
    def reductions(self) -> int:
        """Collective decisions made (``reductions_skipped``: skipped, the deadline far)."""
        return self._vote.reductions

    @property
    def reductions_skipped(self) -> int:
        return self._vote.reductions_skipped

    @property
    def last_decision(self) -> Optional[PolicyDecision]:
        """The decision behind the last should_save() or should_stop() (not status())."""
        return None if self._agreed is None else self._agreed[0]

    # ------------------------------------------------------------------ measuring

    @contextmanager
    def step(self) -> Iterator[None]:
        """Time one training step. A step that raises is not recorded.

        What is recorded is the pass of the loop that this step ends: the time since the
        previous step ended (data loading and the decisions included), less the saves and
        the wait for the release in between; the first step, its own span
        (:mod:`sidecar.train.step_time`).
        """
        started = self._monotonic()
        yield
        self.policy.record_step(self._loop.step_done(started))

    @contextmanager
    def saving(self, step: Optional[int] = None) -> Iterator[None]:
        """Time one save and count it as done. A save that raises is not counted.

        Any save may be timed here, routine ones too: each teaches the policy the save
        time. It is the final save for a deadline only when that deadline was known and
        inside the rule's window when the save started (``SavePolicy.record_save``).

        ``step``: the training step the checkpoint holds (what ``atomic_checkpoint`` is
        given). With it the guard follows the final checkpoint until the daemon's uploader
        has made it durable, and says when (see :meth:`status`).
        """
        started_unix = self._clock()
        deadline = self._deadline_for_save()
        self._saves.started(step, started_unix=started_unix, deadline_unix=deadline)
        started = self._monotonic()
        yield
        self._saves.record(
            max(0.0, self._monotonic() - started), started_unix=started_unix,
            deadline_unix=deadline, step=step,
        )

    def record_step(self, seconds: float) -> None:
        """For callers that time steps themselves (framework callbacks)."""
        self.policy.record_step(seconds)

    def record_save(
        self,
        seconds: float,
        *,
        started_unix: Optional[float] = None,
        step: Optional[int] = None,
        committed: Optional[Callable[[], bool]] = None,
    ) -> None:
        """For callers that time saves themselves; ``started_unix`` defaults to now - seconds.

        Call it right after the save, before the next ``should_save()``: the save is taken
        to be for the deadline that the last ``should_save()`` (or ``should_stop()``) used.
        ``step``: as for :meth:`saving`.

        ``committed``: for a save whose writing goes on after ``seconds`` (an asynchronous
        save: ``seconds`` is its blocking part). The checkpoint counts as saved (durable
        without an uploader; handed to the uploader with one) only once ``committed()``
        returns True; the guard asks it from the training thread, at most once per refresh.
        Tell the guard how long the asynchronous part took with :meth:`record_async_write`.
        """
        if started_unix is None:
            started_unix = self._clock() - seconds
        self._saves.record(seconds, started_unix=started_unix,
                          deadline_unix=self._deadline_for_save(), step=step,
                          committed=committed)

    def record_async_write(self, seconds: float) -> None:
        """How long the asynchronous part of a save took (from the end of its blocking part
        until it was committed). The largest of the last few is added to the time a save
        needs to become durable, like an upload. Safe to call from any thread (a save's
        completion callback)."""
        self._upload.record_async_write(seconds)

    def async_write_estimate(self) -> Optional[float]:
        """The largest of the last few asynchronous parts, None before one finished."""
        return self._upload.async_write_estimate()

    def _deadline_for_save(self) -> Optional[float]:
        """The deadline a save starting now is made for: the last collective decision's
        (every rank records the same one), else this rank's cached one (no request)."""
        if self._agreed is not None:
            return self._agreed[1]
        return self._tracker.deadline(refresh=False)[0]

    def state_dict(self) -> dict[str, object]:
        """What the guard learned, plain JSON, to keep in the checkpoint (step and save
        times, the upload estimate): after :meth:`load_state_dict` the next machine's
        first deadline meets measured values, not the 60 s default (the HF and
        Lightning callbacks do both by themselves)."""
        return guard_state.dump(self.policy, self._upload)

    def load_state_dict(self, state: object) -> bool:
        """Seed the guard from :meth:`state_dict`; False (and one warning) when ``state``
        is not one: a resume never fails because of it."""
        return guard_state.load(state, self.policy, self._upload)

    # ------------------------------------------------------------------ deciding

    def should_save(self) -> bool:
        """Save now? At most once per deadline. Collective when a reducer is set."""
        decision, deadline = self._agree()
        self._saves.asking(decision, self._clock())
        self._notes.decided(decision, deadline, self.sigterm, self._upload.seconds(),
                            self._clock())
        return decision.save_now

    def should_stop(self) -> bool:
        """True once the final save is done and the release has come: leave the loop.

        After the final save the guard waits here (``wait_for_release``, the default:
        :mod:`sidecar.train.release_wait`) until the release time has passed (True: exit
        with :data:`EXIT_RELEASED`; :attr:`released` is True) or the release moved later
        (False: training goes on, the rule re-arms); without it, True right after the final
        save. Collective with a reducer: every rank leaves together. Never for a drill.
        """
        stop = self._should_stop()
        self.stopped = self.stopped or stop
        return stop

    def exit_if_released(self) -> None:
        """``raise SystemExit(EXIT_RELEASED)`` (75) when :meth:`should_stop` said leave
        (the release came, or a SIGTERM): call it after the loop, ``trainer.fit()`` or
        ``trainer.train()``, so that a launcher (``esi-sidecar run``, SkyPilot, a
        Kubernetes Job) resumes the job on the next machine instead of taking it for
        finished. A job that ended on its own returns."""
        if self.stopped:
            logger.info("leaving with exit status %d: stopped for the release",
                        EXIT_RELEASED)
            raise SystemExit(EXIT_RELEASED)

    def finish(self, reason: str = "training ended", *, flush: bool = False) -> None:
        """Tell the daemon the job ended (one ``finished`` event), so that it no longer
        counts it as running: a drill is then refused at once. The callbacks call it at
        the end of training; every guard at the interpreter's exit. ``flush``: send the
        queued events now (within two of the client's timeouts)."""
        if self._finished:
            return
        self._finished = True
        self._events.send("finished", released=self.released or None, reason=reason)
        if flush:
            close = getattr(self.client, "close", None)
            if close is not None:
                with suppress(Exception):  # a client given by the caller; never at exit
                    close()

    def _should_stop(self) -> bool:
        verdict = self._agree()
        if self._drill.holds():  # a drill: the save is real, the stop never is (drill.py)
            return False
        decision = verdict[0]
        starting = decision.stop and not self._stopping
        if starting:
            logger.info("stop training: %s (row %s)", decision.reason,
                        decision.why.value if decision.why else "-")
        self._stopping = decision.stop
        self._durability.follow()
        if not decision.stop or not self.wait_for_release:
            if starting:
                self._events.send("stop", reason=decision.reason,
                                  remaining_seconds=decision.remaining_seconds)
            return decision.stop
        if not self._vote.collective and self._sigterm_deadline() is not None:
            # A SIGTERM is never taken back: leave now, before the SIGKILL.
            self.released = True
            logger.info("SIGTERM received and the checkpoint saved: leaving the training "
                        "loop (exit status %d)", EXIT_RELEASED)
            self._events.send("stop", released=True, reason="SIGTERM received and the "
                              "checkpoint saved")
            return True
        waited_from = self._monotonic()
        released = self._release.wait(verdict, refresh_seconds=self._tracker.refresh_seconds,
                                      decide=self._agree, follow=self._durability.follow)
        self._loop.pause(self._monotonic() - waited_from)  # nor is the wait
        if released:
            self.released = True
        else:  # training resumes: the rule re-arms, the next final save is followed
            self._stopping = False
            self._durability.forget()
        return released

    def maybe_save(self, save: Callable[[], T], step: Optional[int] = None) -> bool:
        """Call ``save()`` inside :meth:`saving` (with ``step``) when :meth:`should_save`;
        True if it ran."""
        if not self.should_save():
            return False
        with self.saving(step):
            save()
        return True

    def status(self) -> GuardStatus:
        """This rank's view, without the reducer (never collective): for logging."""
        decision, _deadline = self._decide(reduce=False)
        self._durability.follow()
        known = with_sigterm(self.sigterm, with_slurm(
            self._slurm, self._tracker.reachable, self._tracker.candidate(refresh=False)))
        deadline, source = (None, None) if known is None else (known.unix, known.source)
        return GuardStatus.of(decision, deadline, source, self._tracker, self._durability,
                              self.last_error, self._routine.plan)

    def _agree(self) -> Verdict:
        """The collective decision, kept as the one the next save is recorded for."""
        self._agreed = self._decide(reduce=True)
        return self._agreed

    def _decide(self, *, reduce: bool) -> Verdict:
        """The decision, and the absolute deadline it used (reduced across ranks)."""
        now_unix = self._clock()
        vote = self._local.of(now_unix, self.sigterm)
        self._upload.warn_on_change()
        collective = reduce and self._vote.collective
        if collective:
            far = self._vote.reuse()
            if far is not None:
                return far
            vote = self._vote.agree(vote)
        policy, after_final = self.policy, vote.steps_after_final
        decision = policy.decide(
            vote.remaining_seconds,
            step_seconds=vote.step_seconds,
            save_seconds=policy.save_seconds if vote.save_seconds is None else vote.save_seconds,
            covered_seconds=vote.covered_seconds,
            upload_seconds=vote.upload_seconds,
            steps_after_final=UNKNOWN_AFTER_FINAL if after_final is None else after_final,
            typical_step_seconds=vote.typical_step_seconds,
            # Ranks measure apart: across ranks, the fixed margin ("auto" is per process).
            collective=collective,
            # Unknown (a reducer of seven floats): no fallback save, on every rank alike.
            at_risk_seconds=vote.at_risk_seconds or 0.0,
            machine_deadline=vote.process_deadline == 0.0,  # every rank's is the machine's
            sigterm=self._sigterm_deadline() is not None,
            routine_overdue_seconds=vote.routine_overdue_seconds,
        )
        self._drill.decided(vote, decision, agreed=reduce)
        if reduce and decision.rearmed:  # a renewal: the old cover holds no new work
            policy.forget_cover()
        remaining = vote.remaining_seconds
        verdict = decision, None if remaining is None else now_unix + remaining
        if collective:
            self._vote.schedule(verdict, hold=self._sigterm_deadline() is not None
                                or self._stopping)
        return verdict

    def _sigterm_deadline(self) -> Optional[float]:
        return None if self.sigterm is None else self.sigterm.deadline()


def _finish_at_exit(guard_ref: weakref.ref[CheckpointGuard]) -> None:
    """At the interpreter's exit: a guard that decided at least once says the job ended,
    and how (an exception the interpreter printed, else a normal end)."""
    guard = guard_ref()
    if guard is None or guard._agreed is None:
        return
    failure = getattr(sys, "last_value", None)
    reason = ("the process exited" if failure is None
              else f"the process ended with {type(failure).__name__}")
    guard.finish(reason, flush=True)
