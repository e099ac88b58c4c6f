"""The save policies compared by the simulator, behind one small per-step protocol.

The engine calls, after every training step and in this order, exactly what a training
loop with :class:`sidecar.train.guard.CheckpointGuard` calls::

    record_step(step_seconds)                             # `with guard.step(): ...`
    if should_save(now, deadline, upload):                # guard.should_save()
        record_save(save_seconds, started_seconds)        # `with guard.saving(): ...`
    if should_stop(now, deadline, upload):                # guard.should_stop()
        ...  # waits: ask should_stop again at each news; else the job exits

``deadline`` is the deadline the job knows (None before one is known), on the same clock
as ``now`` (seconds since the run started); ``upload`` what the daemon's uploader would
serve as the next upload's duration (None without an uploader). A policy that ``waits``
stays in the loop after a stop, as ``should_stop()`` does with ``wait_for_release``: the
engine asks it again whenever the known deadline changes, and training resumes when it
says so (a renewal); one that does not wait ends the job at its stop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

from sidecar.models import Expiry
from sidecar.tools.simulate.workloads import COMMIT_TAIL_SECONDS, Trace
from sidecar.train.guard import STATE_VERSION, CheckpointGuard
from sidecar.train.policy import (
    DEFAULT_REDUNDANT_SECONDS,
    DEFAULT_SAVE_SECONDS,
    DEFAULT_TOP_UP_SECONDS,
    SavePolicy,
    verl_rule,
)

__all__ = [
    "POLICIES",
    "OraclePolicy",
    "PeriodicPolicy",
    "Policy",
    "PolicyFactory",
    "RunInfo",
    "SidecarPolicy",
    "SidecarWithPeriodicPolicy",
    "VerlPolicy",
    "WorstCasePolicy",
    "get_policy",
    "top_up_policy",
]


class Policy(Protocol):
    waits: bool  # after a stop, wait for the release or a renewal instead of exiting

    def record_step(self, seconds: float) -> None: ...

    def should_save(self, now_seconds: float, deadline_seconds: Optional[float],
                    upload_seconds: Optional[float] = None) -> bool: ...

    def record_save(self, seconds: float, started_seconds: float) -> None: ...

    def should_stop(self, now_seconds: float, deadline_seconds: Optional[float],
                    upload_seconds: Optional[float] = None) -> bool: ...


@dataclass(frozen=True)
class RunInfo:
    """What a policy may be built with: the run's trace and its true reclaim instant. Only
    the oracle looks; every other policy learns the deadline as the job would."""

    trace: Trace
    reclaim_seconds: float


class PeriodicPolicy:
    """Save when ``interval_seconds`` have passed since the last save started; never stop.

    The run starts from a checkpoint (a resumed job), so the first save is one interval
    in. Deadline-blind on purpose: this is the usual advice ("save every 15-60 min").
    """

    waits = False

    def __init__(self, interval_seconds: float) -> None:
        self.interval_seconds = interval_seconds
        self._last_save_started_seconds = 0.0

    def record_step(self, seconds: float) -> None:
        pass

    def should_save(self, now_seconds: float, deadline_seconds: Optional[float],
                    upload_seconds: Optional[float] = None) -> bool:
        return now_seconds - self._last_save_started_seconds >= self.interval_seconds

    def record_save(self, seconds: float, started_seconds: float) -> None:
        self._last_save_started_seconds = started_seconds

    def should_stop(self, now_seconds: float, deadline_seconds: Optional[float],
                    upload_seconds: Optional[float] = None) -> bool:
        return False


class VerlPolicy:
    """verl's ESI rule as its trainers call it (``ray_trainer.py`` + ``should_save_ckpt_esi``).

    Reproduced from upstream, including the parts that matter here:

    - ``max_steps_duration`` is the running max since the start of the whole step's
      wall time, measured by the ``step`` timer that also encloses the save: a step that
      saved counts as step + save. It is updated at the end of the step, so the check
      uses the max of the previous steps, and is 0 (never save) on the first step.
    - ``save_ckpt_duration`` is fixed at 60 s; ``redundant_time`` is the trainer's
      ``esi_redundant_time`` (0 in verl's config, 120 s in the ESI guide).
    - save when ``remaining > 0 and max_steps_duration > 0 and remaining <= 60 +
      max_steps_duration + redundant_time`` - on EVERY step inside that window - and only
      when ``save_freq > 0`` (the ESI trigger is or-ed into the periodic condition).
    - ``global_steps % save_freq == 0`` also saves; the default here is a ``save_freq``
      larger than any run, so that only the ESI trigger is compared.
    """

    waits = False

    def __init__(
        self,
        redundant_seconds: float = DEFAULT_REDUNDANT_SECONDS,
        save_freq: int = 10**9,
        save_estimate_seconds: float = DEFAULT_SAVE_SECONDS,
    ) -> None:
        self.redundant_seconds = redundant_seconds
        self.save_freq = save_freq
        self.save_estimate_seconds = save_estimate_seconds
        self.max_steps_duration = 0.0
        self.global_steps = 0
        self._this_step_seconds = 0.0

    def close_to_expiration(self, now_seconds: float, deadline_seconds: Optional[float]) -> bool:
        """``should_save_ckpt_esi``: the deadline check, without the ``save_freq`` gate."""
        remaining = None if deadline_seconds is None else deadline_seconds - now_seconds
        return verl_rule(remaining, self.max_steps_duration, self.save_estimate_seconds,
                         self.redundant_seconds)

    def record_step(self, seconds: float) -> None:
        self.global_steps += 1
        self._this_step_seconds = seconds

    def should_save(self, now_seconds: float, deadline_seconds: Optional[float],
                    upload_seconds: Optional[float] = None) -> bool:
        esi = self.close_to_expiration(now_seconds, deadline_seconds)
        return self.save_freq > 0 and (self.global_steps % self.save_freq == 0 or esi)

    def record_save(self, seconds: float, started_seconds: float) -> None:
        self._this_step_seconds += seconds

    def should_stop(self, now_seconds: float, deadline_seconds: Optional[float],
                    upload_seconds: Optional[float] = None) -> bool:
        # End of verl's step: only now does this step's time (save included) count.
        self.max_steps_duration = max(self.max_steps_duration, self._this_step_seconds)
        return False


class _KnownDeadline:
    """Stands in for :class:`~sidecar.train.client.SidecarClient`: a daemon that answers,
    fresh, the deadline the simulated job knows at the simulated time, and its uploader's
    estimate of the next upload (the engine accounts for durability itself)."""

    urls = ("simulated",)
    last_error: Optional[str] = None

    def __init__(self) -> None:
        self.now_seconds = 0.0
        self.deadline_seconds: Optional[float] = None
        self.upload_seconds: Optional[float] = None
        self.upload_measured: Optional[int] = None
        self.notice: Optional[tuple[str, float]] = None

    def expiry(self) -> Expiry:
        deadline = self.deadline_seconds
        uploads = self.upload_seconds is not None
        return Expiry(
            expires_at=None, expires_at_unix=deadline,
            remaining_seconds=None if deadline is None else deadline - self.now_seconds,
            kind=None, source="simulated", instance_id=None, scheduled_instance_id=None,
            observed_at=None, age_seconds=0.0, stale=False, error=None,
            server_time_unix=self.now_seconds,
            upload_seconds=self.upload_seconds, upload_status="ok" if uploads else None,
            upload_measured=self.upload_measured if uploads else None,
        )

    def is_durable(self, step: int) -> bool:
        return True  # the guard's log only; the engine decides what was durable in time

    def source_notices(self) -> Optional[dict[str, Optional[float]]]:
        """The workload's source and notice, as ``GET /v1/protection`` serves them (the
        guard's routine saves); None: the workload declares none."""
        return None if self.notice is None else {self.notice[0]: self.notice[1]}


class SidecarPolicy:
    """This project's policy: the real :class:`~sidecar.train.guard.CheckpointGuard` (and
    its :class:`~sidecar.train.policy.SavePolicy`), not a copy of its bookkeeping.

    The guard runs on the simulated clock and asks a stand-in client for the deadline
    the job knows at every decision (``refresh_seconds=0``), as a training loop with one
    process and no reducer would; ``options`` go to ``SavePolicy``. ``uploads``: the guard
    is told the uploader's estimate (False: the behaviour before durability was budgeted,
    the local save taken as durable). ``waits``: after the final save, wait for the
    release or a renewal (the engine re-asks ``should_stop`` at each news) instead of
    exiting.
    """

    def __init__(self, *, uploads: bool = True, waits: bool = True, **options: Any) -> None:
        self._known = _KnownDeadline()
        self.uploads = uploads
        self.waits = waits
        self.policy = SavePolicy(**options)
        self._saves = 0
        self._measured: Optional[Callable[[], int]] = None
        self.guard = CheckpointGuard(
            self._known,  # type: ignore[arg-type]  # duck-typed: expiry, urls, last_error
            self.policy,
            refresh_seconds=0.0,
            daemon_retry_seconds=0.0,
            clock=self._now,
            monotonic=self._now,
            environ={},
            wait_for_release=False,  # the engine plays the wait, on the simulated clock
        )

    def _now(self) -> float:
        return self._known.now_seconds

    def _at(self, now_seconds: float, deadline_seconds: Optional[float],
            upload_seconds: Optional[float]) -> None:
        self._known.now_seconds = now_seconds
        self._known.deadline_seconds = deadline_seconds
        self._known.upload_seconds = upload_seconds if self.uploads else None
        self._known.upload_measured = None if self._measured is None else self._measured()

    def resume(self, saves: list[float], upload_seconds: Optional[float]) -> None:
        """Seed the guard with what the checkpoint carried, as a resumed job's
        ``load_state_dict`` does: the saves measured before the run, and the upload
        estimate of the uploader before."""
        loaded = self.guard.load_state_dict({"version": STATE_VERSION, "policy": {"saves": saves},
                                             "upload_seconds": upload_seconds})
        assert loaded, "the simulator built a guard state the guard refused"

    def uploads_measured(self, count: Callable[[], int]) -> None:
        """How many uploads the daemon's estimate rests on (``Expiry.upload_measured``),
        asked at every decision."""
        self._measured = count

    def source_notice(self, notice: Optional[tuple[str, float]]) -> None:
        """The running source and its notice, which the daemon would serve the guard."""
        self._known.notice = notice

    def record_step(self, seconds: float) -> None:
        self.guard.record_step(seconds)

    def should_save(self, now_seconds: float, deadline_seconds: Optional[float],
                    upload_seconds: Optional[float] = None) -> bool:
        self._at(now_seconds, deadline_seconds, upload_seconds)
        return self.guard.should_save()

    def record_save(self, seconds: float, started_seconds: float) -> None:
        self._known.now_seconds = started_seconds + seconds
        self._saves += 1
        self.guard.record_save(seconds, started_unix=started_seconds, step=self._saves)

    def should_stop(self, now_seconds: float, deadline_seconds: Optional[float],
                    upload_seconds: Optional[float] = None) -> bool:
        self._at(now_seconds, deadline_seconds, upload_seconds)
        return self.guard.should_stop()


class SidecarWithPeriodicPolicy(SidecarPolicy):
    """The sidecar plus the user's own periodic saves, all inside ``guard.saving()``.

    The usual deployment: periodic saves bound the loss when no deadline is ever known
    in time, and, being measured by the guard, they teach the policy the real save time
    before the final save. A periodic save counts as the final save only when the
    deadline was known and inside the rule's window when it started; otherwise a
    deadline learned after it still gets its own save.
    """

    def __init__(self, interval_seconds: float, **options: Any) -> None:
        super().__init__(**options)
        self.periodic = PeriodicPolicy(interval_seconds)

    def should_save(self, now_seconds: float, deadline_seconds: Optional[float],
                    upload_seconds: Optional[float] = None) -> bool:
        deadline_save = super().should_save(now_seconds, deadline_seconds, upload_seconds)
        return self.periodic.should_save(now_seconds, deadline_seconds) or deadline_save

    def record_save(self, seconds: float, started_seconds: float) -> None:
        super().record_save(seconds, started_seconds)
        self.periodic.record_save(seconds, started_seconds)


class OraclePolicy:
    """The limit: knows every future step, save and upload and the true reclaim, and makes
    one save, after the last step from which the save and its upload still end by the
    reclaim; then the machine idles. No policy that learns the deadline can lose less
    with one save."""

    waits = False

    def __init__(self, run: RunInfo) -> None:
        self.trace = run.trace
        self.reclaim_seconds = run.reclaim_seconds
        self._steps = 0
        self._saved = False

    def _durable_after(self, index: int, now_seconds: float) -> float:
        """Seconds from ``now_seconds`` until save ``index`` started then is durable: its
        upload streamed from the save's start on the run's link (which may slow), the
        thread free (the run's first checkpoint is durable), then the commit."""
        saved = now_seconds + self.trace.save_seconds(index)
        amount, rate = self.trace.upload(index)
        if amount <= 0:
            return saved - now_seconds
        sent = self.trace.link.ends(now_seconds, amount, rate)
        return max(saved, sent) + COMMIT_TAIL_SECONDS - now_seconds

    def record_step(self, seconds: float) -> None:
        self._steps += 1

    def should_save(self, now_seconds: float, deadline_seconds: Optional[float],
                    upload_seconds: Optional[float] = None) -> bool:
        if self._saved:
            return False
        next_step = self.trace.step_seconds(self._steps)
        return (now_seconds + self._durable_after(0, now_seconds) <= self.reclaim_seconds
                < now_seconds + next_step + self._durable_after(0, now_seconds + next_step))

    def record_save(self, seconds: float, started_seconds: float) -> None:
        self._saved = True

    def should_stop(self, now_seconds: float, deadline_seconds: Optional[float],
                    upload_seconds: Optional[float] = None) -> bool:
        return self._saved


class WorstCasePolicy:
    """A floor for one-save policies that never miss: knows the workload's limits, not its
    draws, and learns the deadline as the job does.

    The limits are :class:`Workload`'s ``step_max_seconds`` and ``durable_max_seconds``
    (the upload streamed while the save writes: the longer of the longest save and the
    longest upload, where the link may halve every upload at half speed and lognormal
    uploads at their 99.9th percentile, then the commit). It makes one save at the last
    step from which the longest step and then that still end by the known deadline, then
    the job exits. Where the draws are independent and bounded, a one-save policy that can miss
    on no draw and knows no more than the limits cannot save later, so cannot lose less.
    The sidecar knows neither the limits nor the coming draws; it estimates them from
    what it measured."""

    waits = False

    def __init__(self, run: RunInfo) -> None:
        workload = run.trace.workload
        self._step = workload.step_max_seconds
        self._durable = workload.durable_max_seconds
        self._saved = False

    def record_step(self, seconds: float) -> None:
        pass

    def should_save(self, now_seconds: float, deadline_seconds: Optional[float],
                    upload_seconds: Optional[float] = None) -> bool:
        if self._saved or deadline_seconds is None:
            return False
        return deadline_seconds - now_seconds < self._step + self._durable

    def record_save(self, seconds: float, started_seconds: float) -> None:
        self._saved = True

    def should_stop(self, now_seconds: float, deadline_seconds: Optional[float],
                    upload_seconds: Optional[float] = None) -> bool:
        return self._saved


@dataclass(frozen=True)
class PolicyFactory:
    """A named recipe: each simulated run gets a fresh policy from ``make``."""

    name: str
    description: str
    make: Callable[[RunInfo], Policy]


POLICIES: dict[str, PolicyFactory] = {
    p.name: p
    for p in (
        PolicyFactory("periodic-15", "save every 15 min, deadline-blind",
                      lambda run: PeriodicPolicy(15 * 60.0)),
        PolicyFactory("periodic-30", "save every 30 min, deadline-blind",
                      lambda run: PeriodicPolicy(30 * 60.0)),
        PolicyFactory("periodic-60", "save every 60 min, deadline-blind",
                      lambda run: PeriodicPolicy(60 * 60.0)),
        PolicyFactory("verl", "verl's ESI rule, esi_redundant_time=120 s as the ESI guide sets it",
                      lambda run: VerlPolicy(redundant_seconds=120.0)),
        PolicyFactory("verl-r0", "verl's ESI rule with verl's default esi_redundant_time=0",
                      lambda run: VerlPolicy(redundant_seconds=0.0)),
        PolicyFactory("sidecar-previous", "the sidecar before durability: budgets the local "
                      "save only, exits after its one final save, no top-up",
                      lambda run: SidecarPolicy(uploads=False, waits=False, top_up_seconds=None)),
        PolicyFactory("sidecar-no-top-up", "the sidecar's defaults without the top-up save: "
                      "upload in the budget, waits after the final save (a renewal resumes)",
                      lambda run: SidecarPolicy(top_up_seconds=None)),
        PolicyFactory("sidecar", "the sidecar's defaults: SavePolicy (max of 100 steps, measured "
                      "saves x1.2, 120 s margin) + the upload, the final save, a top-up save "
                      f"with a {DEFAULT_TOP_UP_SECONDS:g} s margin, then waits for the release; "
                      "routine saves where no notice holds a save (routine_seconds=\"auto\"), "
                      "a fallback save before a final one that rests on a long upload, late "
                      "saves whose expected time fits (every simulated deadline is the "
                      "machine's)",
                      lambda run: SidecarPolicy()),
        PolicyFactory("sidecar-no-routine", "the sidecar without routine saves "
                      "(routine_seconds=None): where no notice holds a save, a reclaim loses "
                      "all since the last checkpoint, as before",
                      lambda run: SidecarPolicy(routine_seconds=None)),
        PolicyFactory("sidecar-no-fallback", "the sidecar without the fallback save "
                      "(fallback_saves=False): the final save alone, even when it rests on "
                      "an upload longer than the margin",
                      lambda run: SidecarPolicy(fallback_saves=False)),
        PolicyFactory("sidecar-no-late", "the sidecar, but it never starts a save its padded "
                      "estimate says will not end in time (try_late_saves=False: the default "
                      "before, and the default's choice for a SIGTERM or a Slurm time limit)",
                      lambda run: SidecarPolicy(try_late_saves=False)),
        PolicyFactory("sidecar-try-late", "the sidecar, but it starts a save even when less "
                      "time is left than the save is expected to take (try_late_saves=True)",
                      lambda run: SidecarPolicy(try_late_saves=True)),
        PolicyFactory("sidecar-late-expected", "the sidecar, but it starts a late save when "
                      "its expected time, without the x1.2, still fits "
                      "(try_late_saves=\"expected\")",
                      lambda run: SidecarPolicy(try_late_saves="expected")),
        PolicyFactory("sidecar-auto-margin", "the sidecar with the margin chosen to lose least "
                      "(redundant_seconds=\"auto\", sidecar.train.margin)",
                      lambda run: SidecarPolicy(redundant_seconds="auto")),
        PolicyFactory("sidecar+periodic-30", "the sidecar plus a save every 30 min, all measured "
                      "by the guard; a periodic save is the final one only if the deadline was "
                      "known and inside the window when it started",
                      lambda run: SidecarWithPeriodicPolicy(30 * 60.0)),
        PolicyFactory("worst-case", "knows the workload's limits, not its draws: one save at "
                      "the last step from which the longest step, save and upload still end by "
                      "the deadline, then exits (a floor for one-save policies that never "
                      "miss, where draws are independent; a release moved later costs it the "
                      "extension)",
                      WorstCasePolicy),
        PolicyFactory("oracle", "knows the future: one save after the last step from which the "
                      "save and its upload end by the reclaim (the limit)", OraclePolicy),
    )
}


def top_up_policy(seconds: Optional[float]) -> PolicyFactory:
    """The sidecar with another top-up margin (None: no top-up): the sweep behind the
    default (docs/simulation.md)."""
    label = "none" if seconds is None else f"{seconds:g}"
    return PolicyFactory(f"sidecar-top-up-{label}", f"the sidecar, top_up_seconds={label}",
                         lambda run: SidecarPolicy(top_up_seconds=seconds))


def get_policy(name: str) -> PolicyFactory:
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}") from None
