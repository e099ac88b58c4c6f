"""The training-loop guard: the save rule (``sidecar.train.policy``) fed by the deadline.

Standard library only (plus ``sidecar.train.deadline``, ``sidecar.train.policy``): like the
client, it must import in any training image.

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
counted.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import time
from collections import deque
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Optional, Protocol, TypeVar

from sidecar.train.client import SidecarClient
from sidecar.train.deadline import DEFAULT_REFRESH_SECONDS, DEFAULT_RETRY_SECONDS, DeadlineTracker
from sidecar.train.policy import PolicyDecision, SavePolicy, check_seconds
from sidecar.train.sigterm import SigtermDeadline

__all__ = [
    "EXIT_RELEASED",
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

T = TypeVar("T")

# How "unknown" travels through a MIN/MAX reduction across ranks (see Reducer).
UNKNOWN_REMAINING = math.inf  # reduced with MIN: any rank that knows a deadline wins
UNKNOWN_STEP = -1.0  # reduced with MAX
UNKNOWN_SAVE = -1.0  # reduced with MAX: a save measured on any rank (often rank 0) wins
UNKNOWN_COVERED = -math.inf  # reduced with MAX: a save made on any rank covers everyone
UNKNOWN_UPLOAD = -1.0  # reduced with MAX: the slowest node's upload counts
UNKNOWN_AFTER_FINAL = math.inf  # reduced with MIN: the ranks that recorded the saves count

# The exit status for a job that left its loop because the machine is being released
# (BSD's EX_TEMPFAIL): not a crash; resume on the next machine.
EXIT_RELEASED = 75
STATE_VERSION = 1  # of state_dict()


class Reducer(Protocol):
    """Makes every rank of a distributed job decide alike (``torch.distributed`` etc.).

    Called with this rank's seven numbers, it returns the same seven numbers combined
    across all ranks: ``(MIN remaining_seconds, MAX step_seconds, MAX save_seconds,
    MAX covered_seconds, MAX upload_seconds, MIN steps_after_final, MAX
    typical_step_seconds)``. Unknown values
    arrive as sentinels that survive exactly that reduction: ``remaining_seconds = +inf``
    (no deadline), ``step_seconds = -1`` (no step measured), ``save_seconds = -1`` (no
    save measured: the configured value is used), ``covered_seconds = -inf`` (no save
    made), ``upload_seconds = -1`` (no uploader on this node, or no estimate yet),
    ``steps_after_final = +inf`` (no final save recorded on this rank; -1 means the
    top-up save was made, see ``SavePolicy.steps_after_final``), ``typical_step_seconds
    = -1`` (no step measured). Use float64: remaining times can be large.

    A torch implementation: ``t = torch.tensor([r, -s, -v, -c, -u, a, -m],
    dtype=torch.float64)``, ``all_reduce(t, op=ReduceOp.MIN)``, return ``(t[0], -t[1],
    -t[2], -t[3], -t[4], t[5], -t[6])``.

    The arguments are positional, so any function of seven floats fits. The guard calls
    it exactly once per ``should_save()`` and once per ``should_stop()`` on every rank
    (and, while ``should_stop()`` waits for the release, once per ``refresh_seconds``, as
    many times on every rank): both are collective and must be called on every rank the
    same number of times, or the job hangs. Exceptions from it propagate: skipping a
    collective on one rank would hang the others.
    """

    def __call__(
        self,
        remaining_seconds: float,
        step_seconds: float,
        save_seconds: float,
        covered_seconds: float,
        upload_seconds: float,
        steps_after_final: float,
        typical_step_seconds: float,
        /,
    ) -> tuple[float, float, float, float, float, float, float]: ...


@dataclass(frozen=True)
class GuardStatus:
    """What the guard knows right now, for a log line or a progress bar."""

    remaining_seconds: Optional[float]
    budget_seconds: Optional[float]
    step_seconds: Optional[float]
    save_seconds: float
    deadline_unix: Optional[float]
    deadline_source: Optional[str]  # "daemon", "env" or None
    daemon_reachable: bool
    save_now: bool
    stop: bool
    reason: str
    last_error: Optional[str]
    # Durability (the daemon's checkpoint uploader): how long a save takes to become
    # durable after the local write (None: no uploader or no estimate), its state ("ok",
    # "uploading", "degraded", None without one), the final save's step and when it
    # became durable (a local save is durable at once when no uploader runs).
    upload_seconds: Optional[float] = None
    upload_status: Optional[str] = None
    final_step: Optional[int] = None
    final_durable_at_unix: Optional[float] = None
    # The top-up save after the final one (SavePolicy.top_up_seconds), followed the same way.
    top_up_step: Optional[int] = None
    top_up_durable_at_unix: Optional[float] = None


# Scheduled reduction: when the deadline is far, the ranks agree at most this long (and
# this many decisions) apart instead of at every step.
MAX_SKIP_SECONDS = 5.0
MAX_SKIP_DECISIONS = 200
# record_async_write(): the largest of this many recent asynchronous parts is budgeted.
ASYNC_WRITES_KEPT = 3
# Job events (the daemon's GET /v1/events and /metrics): the step estimate and the budget
# go out at most this often; saves, the wait and the stop each time they happen.
ESTIMATE_EVENT_SECONDS = 30.0


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
    - ``reducer``: see :class:`Reducer`; None for a single process.
    - ``environ``: where to read the fallback deadline variables (default ``os.environ``,
      read once here).
    - ``sigterm_grace_seconds``: take SIGTERM as a deadline this many seconds after it
      came (GCP/Azure preemption, Kubernetes eviction, SLURM ``--signal``: set it a few
      seconds below the platform's grace period). The next step saves; without a
      reducer ``should_stop()`` then returns True at once (a SIGTERM is never renewed);
      across ranks every rank learns the deadline through the reduction and they leave
      together at it. Opt-in, works without any daemon; the guard must be built in the
      main thread, and its handler replaces the process's SIGTERM handler.
    - ``events``: tell this node's daemon what happens (``POST /v1/events``: step
      estimates, saves started and finished, durable checkpoints, the wait, the stop), for
      its ``GET /v1/events`` and ``/metrics`` (docs/events.md). Fire-and-forget: each is
      a queue put, sent by the client's background thread, so no step waits for the
      daemon. Default on; ``job`` names the job in them (default ``hostname:pid``), and
      the rank is ``$RANK`` when set.

    Where the deadline comes from (see :class:`DeadlineTracker`, which caches it): the
    daemon's answer while it has a current one; the environment variables when the daemon
    freshly answers without one, or none was ever known; while a daemon is unreachable or
    answers stale without a deadline, the earlier of its last known deadline and the
    environment's. Not thread-safe: call it from the training loop's thread.
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
        self._reducer = reducer
        self.wait_for_release = wait_for_release
        self._sleep = sleep
        self.released = False  # should_stop() returned True because the release came
        self._upload_fallback: Optional[float] = None  # from load_state_dict()
        # The asynchronous part of recent saves (record_async_write): it runs after the
        # blocking part, before any upload can start. A deque: appended from any thread.
        self._async_writes: deque[float] = deque(maxlen=ASYNC_WRITES_KEPT)
        self._warned_internal = False
        self._stopping = False
        self._last_decision: Optional[PolicyDecision] = None
        self._last_save_decision: Optional[PolicyDecision] = None
        # The deadline (reduced across ranks) behind the last should_save()/should_stop();
        # _decided is False until one of them ran.
        self._decided = False
        self._decided_deadline: Optional[float] = None
        self._final = _FinalSave()
        self._top_up = _FinalSave()
        self._warned_upload: Optional[str] = None  # the upload state last warned about
        self.sigterm: Optional[SigtermDeadline] = None
        if sigterm_grace_seconds is not None:
            self.sigterm = SigtermDeadline(sigterm_grace_seconds, clock)
            self.sigterm.install()
        self._said_sigterm = False
        self._said_too_late: Optional[float] = None
        # Scheduled reduction (see _reductions_to_skip): the far verdict every rank reuses,
        # and how many more reducing decisions reuse it before the next collective.
        self._far: Optional[tuple[PolicyDecision, Optional[float]]] = None
        self._skip_reductions = 0
        #: Collective decisions made, and those skipped because the deadline was far.
        self.reductions = 0
        self.reductions_skipped = 0
        # Job events: a duck-typed client without send_event() (the simulator's, Ray's
        # NodeDeadlines) sends none.
        self._send_event = getattr(self.client, "send_event", None) if events else None
        self._job = _job_id(job)
        self._rank = _rank_from_environment()
        self._next_estimate = -math.inf  # monotonic

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

    # ------------------------------------------------------------------ measuring

    @contextmanager
    def step(self) -> Iterator[None]:
        """Time one training step. A step that raises is not recorded."""
        started = self._monotonic()
        yield
        self.policy.record_step(max(0.0, self._monotonic() - started))

    @contextmanager
    def saving(self, step: Optional[int] = None) -> Iterator[None]:
        """Time one save and count it as done. A save that raises is not counted.

        Any save may be timed here, routine ones too: each teaches the policy the save
        time. It counts as the final save for a deadline only when that deadline was
        known and inside the rule's window when the save started (see
        ``SavePolicy.record_save``).

        ``step``: the training step the checkpoint holds (what ``atomic_checkpoint`` is
        given). With it the guard follows the final checkpoint until the daemon's uploader
        has made it durable, and says when (see :meth:`status`).
        """
        started_unix = self._clock()
        deadline = self._deadline_for_save()
        asked = self._last_save_decision
        self._event("save-started", step=step, save=_save_kind(asked),
                    budget_seconds=None if asked is None else asked.budget_seconds,
                    remaining_seconds=None if deadline is None else deadline - started_unix)
        started = self._monotonic()
        yield
        self._record_save(
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
        self._record_save(seconds, started_unix=started_unix,
                          deadline_unix=self._deadline_for_save(), step=step,
                          committed=committed)

    def record_async_write(self, seconds: float) -> None:
        """How long the asynchronous part of a save took (from the end of its blocking part
        until it was committed). The largest of the last few is added to the time a save
        needs to become durable, like an upload. Safe to call from any thread (a save's
        completion callback)."""
        self._async_writes.append(check_seconds("async write seconds", seconds))

    def async_write_estimate(self) -> Optional[float]:
        """The largest of the last few asynchronous parts, None before one finished."""
        writes = list(self._async_writes)
        return max(writes) if writes else None

    def _deadline_for_save(self) -> Optional[float]:
        """The deadline a save starting now is made for.

        The one behind the last collective decision (reduced across ranks, so every rank
        records the same deadline whichever rank knew it), else this rank's cached one
        (no request: a save must not wait for the daemon).
        """
        if self._decided:
            return self._decided_deadline
        return self._tracker.deadline(refresh=False)[0]

    def _record_save(
        self,
        seconds: float,
        *,
        started_unix: float,
        deadline_unix: Optional[float],
        step: Optional[int] = None,
        committed: Optional[Callable[[], bool]] = None,
    ) -> None:
        # The budget of the decision that asked for this save, so that the save covers
        # what that decision promised; the deadline known when it started, so that a
        # routine save made before the deadline was known (or while it was far) does not
        # count as the final save (see SavePolicy.record_save).
        asked = self._last_save_decision
        budget = None if asked is None else asked.budget_seconds
        self.policy.record_save(
            seconds, started_unix=started_unix, deadline_unix=deadline_unix, budget_seconds=budget
        )
        self._event("save-finished", step=step, seconds=seconds, save=_save_kind(asked),
                    asynchronous=True if committed is not None else None,
                    remaining_seconds=None if deadline_unix is None
                    else deadline_unix - self._clock())
        if asked is not None and asked.save_now:  # the save the rule asked for
            now = self._clock()
            uploads = self._tracker.upload_status is not None
            saved = _FinalSave(step=step, deadline_unix=deadline_unix, saved_unix=now,
                               durable_unix=None if uploads or committed else now,
                               top_up=asked.top_up, committed=committed)
            if asked.top_up:
                self._top_up = saved
            else:
                self._final, self._top_up = saved, _FinalSave()
            if uploads and step is None:
                logger.warning("the %s checkpoint was saved without a step number "
                               "(guard.saving(step=N)): its upload cannot be followed",
                               saved.name)

    # ------------------------------------------------------------------ resume

    def state_dict(self) -> dict[str, object]:
        """What the guard learned, plain JSON, to keep in the checkpoint: recent step and
        save times, and the last upload estimate. :meth:`load_state_dict` after a resume
        makes the first deadline on the next machine meet measured values, not the 60 s
        default (the HF and Lightning callbacks do both by themselves)."""
        return {
            "version": STATE_VERSION,
            "policy": self.policy.state_dict(),
            "upload_seconds": self._tracker.upload_seconds or self._upload_fallback,
        }

    def load_state_dict(self, state: object) -> bool:
        """Seed the guard from :meth:`state_dict`; False (and one warning) when ``state``
        is not one: a resume never fails because of it."""
        try:
            if not isinstance(state, Mapping) or state.get("version") != STATE_VERSION:
                raise ValueError(f"not a guard state of version {STATE_VERSION}")
            policy = state.get("policy", {})
            if not isinstance(policy, Mapping):
                raise ValueError("policy must be a mapping")
            upload = state.get("upload_seconds")
            if upload is not None:
                upload = check_seconds("upload_seconds", upload)
            self.policy.load_state_dict(policy)
        except (ValueError, TypeError) as exc:
            logger.warning("ignoring the saved guard state: %s", exc)
            return False
        self._upload_fallback = upload
        return True

    # ------------------------------------------------------------------ deciding

    def should_save(self) -> bool:
        """Save now? At most once per deadline. Collective when a reducer is set."""
        decision, self._decided_deadline = self._decide(reduce=True)
        self._decided = True
        self._last_decision = self._last_save_decision = decision
        if decision.save_now:
            logger.info("%s now: %s", "top-up checkpoint" if decision.top_up else "checkpoint",
                        decision.reason)
        elif decision.too_late and self._said_too_late != self._decided_deadline:
            self._said_too_late = self._decided_deadline  # once per deadline
            logger.warning("no checkpoint for this release: %s", decision.reason)
            self._event("too-late", reason=decision.reason,
                        remaining_seconds=decision.remaining_seconds)
        if self._send_event is not None and self._monotonic() >= self._next_estimate:
            self._next_estimate = self._monotonic() + ESTIMATE_EVENT_SECONDS
            self._event("step-estimate", step_seconds=decision.step_seconds,
                        save_seconds=decision.save_seconds,
                        budget_seconds=decision.budget_seconds,
                        remaining_seconds=decision.remaining_seconds)
        return decision.save_now

    def should_stop(self) -> bool:
        """True once the final save is done and the release has come: leave the loop.

        After the final save no further step could be saved in time, so the guard waits
        here (``wait_for_release``, the default), asking the daemon as usual, until
        either the release time has passed (True: leave the loop, and exit with
        :data:`EXIT_RELEASED` so a launcher tells it from a crash; :attr:`released` is
        True) or the release moved later, a renewal (False: training goes on in the same
        process and the rule re-arms). Without ``wait_for_release`` it returns True right
        after the final save, as before.

        Collective when a reducer is set (so that every rank leaves the loop together);
        the wait asks the other ranks once per ``refresh_seconds`` until shortly before
        the earliest release of any node, then only watches its own clock, so a node
        that goes away never leaves the others inside a collective.
        """
        decision, self._decided_deadline = self._decide(reduce=True)
        self._decided = True
        self._last_decision = decision
        starting = decision.stop and not self._stopping
        if starting:
            logger.info("stop training: %s", decision.reason)
        self._stopping = decision.stop
        self._follow_final_save()
        if not decision.stop or not self.wait_for_release:
            if starting:
                self._event("stop", reason=decision.reason,
                            remaining_seconds=decision.remaining_seconds)
            return decision.stop
        if self._reducer is None and self._sigterm_deadline() is not None:
            # A SIGTERM is never taken back: leave now, before the SIGKILL.
            self.released = True
            logger.info("SIGTERM received and the checkpoint saved: leaving the training "
                        "loop (exit status %d)", EXIT_RELEASED)
            self._event("stop", released=True, reason="SIGTERM received and the checkpoint "
                        "saved")
            return True
        return self._wait_for_release(decision)

    def _wait_for_release(self, decision: PolicyDecision) -> bool:
        interval = max(0.05, self._tracker.refresh_seconds)
        # Collectives stop this long before the earliest release (judged on the reduced
        # remaining time, which every rank sees alike), so no rank is inside one when a
        # node goes away.
        quiet_seconds = 2 * interval + 1.0
        asking = decision.remaining_seconds is not None and (
            self._reducer is None or decision.remaining_seconds > quiet_seconds
        )
        logger.info("final checkpoint saved; waiting for the release%s (training resumes "
                    "if it moves later)", _in(decision.remaining_seconds))
        self._event("waiting", reason=decision.reason,
                    remaining_seconds=decision.remaining_seconds)
        while True:
            deadline = self._decided_deadline
            if deadline is None:  # the release was called off
                logger.info("the release was called off: training resumes")
                self._event("resumed", reason="the release was called off")
                self._resume_after_wait()
                return False
            remaining = deadline - self._clock()
            if remaining <= 0:
                self.released = True
                logger.info("the release time has passed: leaving the training loop "
                            "(exit status %d)", EXIT_RELEASED)
                self._event("stop", released=True, reason="the release time has passed")
                return True
            self._sleep(min(interval, remaining))
            self._follow_final_save()
            if not asking:
                continue
            decision, self._decided_deadline = self._decide(reduce=True)
            self._last_decision = decision
            if not decision.stop:
                logger.info("the release moved later (now%s): training resumes",
                            _in(decision.remaining_seconds))
                self._event("resumed", reason="the release moved later",
                            remaining_seconds=decision.remaining_seconds)
                self._resume_after_wait()
                return False
            if self._reducer is not None and (
                decision.remaining_seconds is None or decision.remaining_seconds <= quiet_seconds
            ):
                asking = False

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
        self._follow_final_save()
        deadline, source = self._tracker.deadline(refresh=False)
        deadline, source = self._with_sigterm(deadline, source)
        final, top_up = self._final, self._top_up
        return GuardStatus(
            remaining_seconds=decision.remaining_seconds,
            budget_seconds=decision.budget_seconds,
            step_seconds=decision.step_seconds,
            save_seconds=decision.save_seconds,
            deadline_unix=deadline,
            deadline_source=source,
            daemon_reachable=self._tracker.reachable,
            save_now=decision.save_now,
            stop=decision.stop,
            reason=decision.reason,
            last_error=self.last_error,
            upload_seconds=self._tracker.upload_seconds,
            upload_status=self._tracker.upload_status,
            final_step=final.step,
            final_durable_at_unix=final.durable_unix,
            top_up_step=top_up.step,
            top_up_durable_at_unix=top_up.durable_unix,
        )

    def _resume_after_wait(self) -> None:
        self._stopping = False
        # The release it was saved for did not come: the next final save is followed, and
        # no "NOT durable before the release" is said for a release that did not happen.
        self._final = _FinalSave()
        self._top_up = _FinalSave()

    def _follow_final_save(self) -> None:
        """Ask, at most once per refresh, whether the final (and top-up) checkpoint is
        durable yet; say so once, or say loudly that the release came first. Never raises."""
        self._follow(self._final)
        self._follow(self._top_up)

    def _follow(self, final: _FinalSave) -> None:
        if final.saved_unix is None or final.reported:
            return
        now = self._clock()
        lead = None if final.deadline_unix is None else final.deadline_unix - now
        uploads = self._tracker.upload_status is not None
        if final.durable_unix is None and self._monotonic() >= final.next_check:
            final.next_check = self._monotonic() + self._tracker.refresh_seconds
            if final.committed is not None and final.committed_unix is None:
                try:
                    done = bool(final.committed())
                except Exception:  # the caller's function; never into the training loop
                    done = False
                if done:
                    final.committed_unix = now
                    if not uploads:
                        final.durable_unix = now
            if final.durable_unix is None and final.step is not None and (
                final.committed is None or final.committed_unix is not None
            ):
                try:
                    durable = self.client.is_durable(final.step)
                except Exception:  # a client given by the caller may raise
                    durable = None
                if durable:
                    final.durable_unix = now
        if final.durable_unix is not None:
            final.reported = True
            self._event("durable", step=final.step, save=final.name,
                        lead_seconds=None if final.deadline_unix is None
                        else final.deadline_unix - final.durable_unix)
            local = "" if self._tracker.upload_status else " (no uploader: the local save counts)"
            if final.deadline_unix is None:
                logger.info("%s checkpoint (step %s) durable%s", final.name, final.step, local)
            else:
                logger.info("%s checkpoint (step %s) durable %.1f s before the release%s",
                            final.name, final.step,
                            final.deadline_unix - final.durable_unix, local)
        elif lead is not None and lead <= 0:
            final.reported = True
            unwritten = final.committed is not None and final.committed_unix is None
            upload = self._tracker.upload_status or "no answer"
            self._event("not-durable", step=final.step, save=final.name, reason=(
                "its asynchronous write had not finished" if unwritten
                else f"the upload had not finished ({upload})") + " when the release came")
            if final.committed is not None and final.committed_unix is None:
                logger.error("%s checkpoint (step %s) was NOT committed before the release: "
                             "its asynchronous write had not finished", final.name, final.step)
            elif final.top_up:  # the final checkpoint before it is the one to resume from
                logger.warning("top-up checkpoint (step %s) was not durable before the "
                               "release (%s); resume picks the final checkpoint (step %s)",
                               final.step, self._tracker.upload_status or "no answer",
                               self._final.step)
            else:
                logger.error("final checkpoint (step %s) was NOT durable before the release: "
                             "the uploader had not finished (%s)", final.step,
                             self._tracker.upload_status or "no answer")

    def _event(self, kind: str, **fields: object) -> None:
        """Queue one job event for this node's daemon (``events``); never raises, never
        waits: the client's thread sends it. None and non-finite values are left out."""
        send = self._send_event
        if send is None:
            return
        try:
            event: dict[str, object] = {"kind": kind, "job": self._job, "at_unix": self._clock()}
            if self._rank is not None:
                event["rank"] = self._rank
            for name, value in fields.items():
                finite = not isinstance(value, float) or math.isfinite(value)
                if value is not None and finite:
                    event[name] = value
            send(event)
        except Exception:  # a client given by the caller may raise; events are never worth it
            pass

    @property
    def last_decision(self) -> Optional[PolicyDecision]:
        """The decision behind the last should_save() or should_stop() (not status())."""
        return self._last_decision

    def _decide(self, *, reduce: bool) -> tuple[PolicyDecision, Optional[float]]:
        """The decision, and the absolute deadline it used (reduced across ranks)."""
        now_unix = self._clock()
        deadline: Optional[float] = None
        try:
            deadline, _source = self._tracker.deadline()
        except Exception:  # a bug of ours must not stop training
            if not self._warned_internal:
                logger.exception("sidecar client failed; deciding without a deadline")
                self._warned_internal = True
        deadline, _source = self._with_sigterm(deadline, None)
        policy = self.policy
        remaining = None if deadline is None else deadline - now_unix
        step = policy.step_estimate()
        typical = policy.typical_step_estimate()
        measured_save = policy.measured_save_estimate()
        covered = policy.covered_seconds(now_unix)
        upload = self._tracker.upload_seconds
        if upload is None and self._tracker.upload_status is not None:
            upload = self._upload_fallback  # a new uploader knows no rate yet: the saved one
        async_write = self.async_write_estimate()
        if async_write is not None:  # written after the blocking part, before any upload
            upload = async_write + (upload or 0.0)
        after_final: Optional[float] = None  # the policy's own
        if self._sigterm_deadline() is not None:
            after_final = -1.0  # as if topped up: after a SIGTERM, one save and leave
        self._warn_upload_state()
        collective = reduce and self._reducer is not None
        if collective and self._skip_reductions > 0 and self._far is not None:
            # Every rank counts the same collective decisions and computed the same skip
            # from the same reduced numbers: all of them skip this one, none waits.
            self._skip_reductions -= 1
            self.reductions_skipped += 1
            return self._far
        if collective:
            assert self._reducer is not None
            self.reductions += 1
            reduced = self._reducer(
                UNKNOWN_REMAINING if remaining is None else remaining,
                UNKNOWN_STEP if step is None else step,
                UNKNOWN_SAVE if measured_save is None else measured_save,
                UNKNOWN_COVERED if covered is None else covered,
                UNKNOWN_UPLOAD if upload is None else upload,
                policy.steps_after_final() if after_final is None else after_final,
                UNKNOWN_STEP if typical is None else typical,
            )
            r, s, v, c, u, a, m = (float(x) for x in reduced)
            remaining = None if math.isinf(r) or math.isnan(r) else r
            step = None if s < 0 or math.isnan(s) else s
            measured_save = None if v < 0 or math.isnan(v) else v
            covered = None if math.isinf(c) or math.isnan(c) else c
            upload = None if u < 0 or math.isnan(u) or math.isinf(u) else u
            after_final = UNKNOWN_AFTER_FINAL if math.isnan(a) else a
            typical = None if m < 0 or math.isnan(m) else m
        decision = policy.decide(
            remaining,
            step_seconds=step,
            save_seconds=policy.save_seconds if measured_save is None else measured_save,
            covered_seconds=covered,
            upload_seconds=upload,
            steps_after_final=after_final,
            typical_step_seconds=typical,
        )
        result = decision, None if remaining is None else now_unix + remaining
        if collective:
            self._skip_reductions = self._reductions_to_skip(decision)
            self._far = result if self._skip_reductions else None
        return result

    def _reductions_to_skip(self, decision: PolicyDecision) -> int:
        """How many of the next collective decisions may reuse this one, computed from
        reduced numbers only (so every rank gets the same count).

        Only a far verdict is reused: no save, no stop, a measured step, no SIGTERM, and
        the deadline (if any) more than the budget away. The skipped steps last at most
        half the slack and at most MAX_SKIP_SECONDS (1 s with a SIGTERM grace), judged on
        the slowest rank's step: a deadline that a node learns meanwhile (a spot notice)
        reaches the other ranks that much later, never after the slack is gone.
        """
        step = decision.step_seconds
        if decision.save_now or decision.stop or step is None or step <= 0:
            return 0
        if self._sigterm_deadline() is not None or self._stopping:
            return 0
        slack = math.inf
        if decision.remaining_seconds is not None:
            if decision.budget_seconds is None:
                return 0
            slack = decision.remaining_seconds - decision.budget_seconds
        if slack <= 0:
            return 0
        window = min(MAX_SKIP_SECONDS if self.sigterm is None else 1.0, slack / 2)
        # Two collective decisions per step: should_save() and should_stop().
        return min(MAX_SKIP_DECISIONS, 2 * int(window // step))

    def _sigterm_deadline(self) -> Optional[float]:
        return None if self.sigterm is None else self.sigterm.deadline()

    def _with_sigterm(
        self, deadline: Optional[float], source: Optional[str]
    ) -> tuple[Optional[float], Optional[str]]:
        """The earlier of ``deadline`` and the SIGTERM's, said once when it came."""
        term = self._sigterm_deadline()
        if term is None:
            return deadline, source
        if not self._said_sigterm:
            self._said_sigterm = True
            logger.warning("SIGTERM received: the machine goes in %.0f s; saving at the next "
                           "decision", max(0.0, term - self._clock()))
        if deadline is None or term < deadline:
            return term, "sigterm"
        return deadline, source

    def _warn_upload_state(self) -> None:
        """One line when the uploader starts failing, one when it is back."""
        state = self._tracker.upload_status
        if state == "degraded" and self._warned_upload != "degraded":
            logger.warning("checkpoint uploads are failing (the daemon's /v1/uploads says "
                           "why): a checkpoint saved now may not become durable before the "
                           "release")
            self._warned_upload = "degraded"
        elif state != "degraded" and self._warned_upload == "degraded":
            logger.info("checkpoint uploads work again")
            self._warned_upload = state


def _save_kind(asked: Optional[PolicyDecision]) -> str:
    """What a save made now is for, as the guard follows it (see _record_save)."""
    if asked is None or not asked.save_now:
        return "routine"
    return "top-up" if asked.top_up else "final"


def _job_id(job: Optional[str]) -> str:
    """The job's name in its events: the caller's (checked), else hostname:pid."""
    if job is None:
        name = "".join(c if 33 <= ord(c) <= 126 else "-" for c in socket.gethostname())
        return f"{name[:100] or 'host'}:{os.getpid()}"
    if not isinstance(job, str) or not 0 < len(job) <= 128 or not all(
        33 <= ord(c) <= 126 for c in job
    ):
        raise ValueError(f"job must be 1 to 128 printable ASCII characters without spaces, "
                         f"got {job!r}")
    return job


def _rank_from_environment() -> Optional[int]:
    """``$RANK`` (torchrun, Lightning, DeepSpeed set it), when it is a plain number."""
    value = os.environ.get("RANK", "").strip()
    if value.isascii() and value.isdigit() and int(value) <= 1_000_000:
        return int(value)
    return None


def _in(remaining_seconds: Optional[float]) -> str:
    return "" if remaining_seconds is None else f" in {remaining_seconds:.0f} s"


@dataclass
class _FinalSave:
    """The final checkpoint, followed until it is durable (or the release comes first)."""

    step: Optional[int] = None
    deadline_unix: Optional[float] = None
    saved_unix: Optional[float] = None
    durable_unix: Optional[float] = None
    next_check: float = -math.inf  # monotonic
    reported: bool = False
    top_up: bool = False
    # An asynchronous save: it counts once committed() is True (committed_unix).
    committed: Optional[Callable[[], bool]] = None
    committed_unix: Optional[float] = None

    @property
    def name(self) -> str:
        return "top-up" if self.top_up else "final"
