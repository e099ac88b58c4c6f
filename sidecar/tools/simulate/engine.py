"""The discrete-event loop: one job, one deadline schedule, one policy; no sleeping.

Time is a float (seconds since the run started) advanced by drawn durations, so a two
hour run costs a few hundred loop turns. The definitions below are the ones
docs/simulation.md states; keep the two in step.

- The machine is reclaimed at the first instant the true deadline is reached; its local
  disk goes with it. A checkpoint counts only once it is *durable*: at once without an
  uploader, else when its upload ended (see :class:`Uploads`, the daemon's uploader in a
  few lines: one upload at a time, newest first, an older one near the release yields to
  a newer one unless both still end in time; the estimate and that rule are the daemon's
  own, ``sidecar.host.upload.plan``, the upload in progress included). The link may slow
  (the workload's ``link_halves``); while no upload runs the daemon probes it as
  ``plan.probe_interval`` says (a probe takes no time from the uploads here: it sends
  ``plan.PROBE_SECONDS`` of bytes, and the link is idle). The first estimate is the one
  the checkpoint carried from the machine before: its daemon's, over ``plan.RATE_WINDOW``
  uploads it measured.
- A deadline change reaches the job ``notice_delay_seconds`` after it happened (the daemon
  serves it after its next poll); the deadline known at the start is known at once.
- ``lead``: reclaim time minus the time the job learned the deadline that was enforced.
  A run is *feasible* when ``lead >= step_max + save_max + upload_max``: even from the
  worst point (a worst-case step just started) one more step, one save and its upload fit.
- The *final window* opens at the later of that learning time and ``W`` before the
  reclaim, ``W = step_max + save_max + upload_max + 120 s`` (the seed rule's budget with
  the workload's worst step, save and upload, and the guide's margin).
- A run *misses* when, at the reclaim, training was done since the newest durable
  checkpoint and that checkpoint's save ended before the final window opened.
- *Lost* GPU time: everything after the training state the next machine resumes from
  (the start of the newest durable checkpoint's save) until the reclaim: steps to redo,
  saves, idling. The oracle's loss is the least any one save can do.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Callable, Optional, Union

from sidecar.host.settings import DEFAULT_UPLOAD_NEAR_RELEASE_SECONDS
from sidecar.host.upload import plan
from sidecar.tools.simulate.policies import (
    POLICIES,
    PolicyFactory,
    RunInfo,
    SidecarPolicy,
    get_policy,
    top_up_policy,
)
from sidecar.tools.simulate.workloads import (
    WORKLOADS,
    DeadlineChange,
    Link,
    Workload,
    get_workload,
)
from sidecar.train.policy import quantile
from sidecar.train.reclaim_cost import lost_seconds, redone_seconds

__all__ = [
    "DEFAULT_NOTICE_DELAY_SECONDS",
    "WINDOW_MARGIN_SECONDS",
    "Result",
    "RunOutcome",
    "Uploads",
    "durable_times",
    "run",
    "simulate_run",
    "top_up_sweep",
]

DEFAULT_NOTICE_DELAY_SECONDS = 30.0  # one poll interval of the daemon (its default)
# The plan's amounts here are upload durations, the daemon's bytes: at rate 1 an upload's
# amount is its own duration.
UPLOAD_RATE = 1.0
FULL_SPEED = Link()  # a link that never slows
WINDOW_MARGIN_SECONDS = 120.0  # the ESI guide's redundant time, used to size the final window
# The top-up margins compared to choose SavePolicy's default (None: no top-up).
TOP_UP_MARGINS: tuple[Optional[float], ...] = (None, 0.0, 5.0, 10.0, 20.0, 30.0, 60.0)


@dataclass(frozen=True)
class RunOutcome:
    """What happened in one simulated run (one workload, policy and seed)."""

    workload: str
    policy: str
    seed: int
    reclaim_seconds: float
    learned_seconds: float  # when the job learned the deadline that was enforced
    feasible: bool
    missed: bool
    lost_seconds: float  # GPU time after the state the next machine resumes from
    unsaved_seconds: float  # of which training time (steps to redo)
    saves: int  # completed saves
    window_saves: int  # saves ending inside the final window (one cut by the reclaim too)
    interrupted_save: bool  # a save was in progress at the reclaim
    saving_seconds: float  # time spent saving, the interrupted save included
    idle_seconds: float  # time neither training nor saving (stopped, or waiting)
    steps: int  # steps completed

    @property
    def lead_seconds(self) -> float:
        return self.reclaim_seconds - self.learned_seconds


@dataclass(frozen=True)
class Result:
    """One (policy, workload) pair over many seeds. Times in seconds, per reclaim."""

    workload: str
    policy: str
    runs: int
    feasible_runs: int
    misses: int  # among feasible runs
    infeasible_misses: int
    lost_median_seconds: float
    lost_mean_seconds: float
    lost_p95_seconds: float
    lost_max_seconds: float
    unsaved_mean_seconds: float
    saves_mean: float
    window_saves_mean: float
    window_saves_max: int
    interrupted_saves: int
    saving_mean_seconds: float
    idle_mean_seconds: float

    @property
    def infeasible_runs(self) -> int:
        return self.runs - self.feasible_runs


@dataclass(frozen=True)
class Checkpoint:
    """A completed local save: the training state of ``state_seconds``, on disk at
    ``saved_seconds``, with ``upload_seconds`` to upload (the amount: its duration at
    ``upload_rate`` 1 on a link at full speed)."""

    state_seconds: float
    saved_seconds: float
    upload_seconds: float
    upload_rate: float = 1.0


def _known_from(change: DeadlineChange, notice_delay_seconds: float) -> float:
    return 0.0 if change.at_seconds <= 0 else change.at_seconds + notice_delay_seconds


def _reclaim(changes: Sequence[DeadlineChange]) -> tuple[float, int]:
    """The reclaim instant and the index of the change that set the enforced deadline."""
    for index, change in enumerate(changes):
        ends = changes[index + 1].at_seconds if index + 1 < len(changes) else math.inf
        if change.deadline_seconds is not None and change.deadline_seconds < ends:
            return max(change.deadline_seconds, change.at_seconds), index
    raise ValueError("the schedule never reclaims the machine")


class Uploads:
    """The daemon's uploader in a few lines, fed the checkpoints as they are saved: one
    upload at a time; a checkpoint arriving while one runs waits (replacing an older one
    waiting, which is skipped); near the release the running upload gives way to the newer
    one as ``plan.gives_way`` says (the daemon's default ``--upload-near-release``; the
    newer one's size guessed as the largest recent upload). The estimate it serves is the
    daemon's: ``plan`` over the uploads done, updated by the one in progress
    (``plan.in_progress_rate``); ``first_estimate`` (the one saved in the checkpoint)
    until one was done here; ``prior``: the ``(amount, seconds)`` the machine before
    measured, the rate the give-way rule assumes until then. While none runs, the link is
    probed (``plan.probe_interval``; ``probe_rate(k)``: the link's rate the k-th probe
    meets, on top of ``link``; ``probes=False``: never, as before issue 23)."""

    def __init__(self, known_deadline: Callable[[float], Optional[float]],
                 first_estimate: Optional[float], *, link: Link = FULL_SPEED,
                 prior: Sequence[tuple[float, float]] = (),
                 probe_rate: Callable[[int], float] = lambda index: 1.0,
                 probes: bool = True) -> None:
        self._known_deadline = known_deadline
        self._first_estimate = first_estimate
        self._link = link
        self._prior = list(prior)
        self.checkpoints: list[Checkpoint] = []
        self.durable: list[float] = []  # inf: not (yet) durable
        # Amounts, oldest first, for the newer one's size (the saved estimate's first).
        self._sizes = [] if first_estimate is None else [first_estimate / plan.ESTIMATE_MARGIN]
        self._done: list[tuple[float, float]] = []  # (amount, seconds) uploaded here
        self._running: Optional[tuple[int, float, float]] = None  # index, started, ends
        self._waiting: Optional[int] = None
        self._probes = probes
        self._probe_rate = probe_rate
        self._measured_at = 0.0  # the last upload's end or probe
        self._probes_since: list[float] = []  # rates the probes since the last upload measured
        self.probe_count = 0
        self._probe_at: Optional[float] = None  # when the next probe goes (cached)

    def _start(self, index: int, at: float) -> None:
        checkpoint = self.checkpoints[index]
        ends = self._link.ends(at, checkpoint.upload_seconds, checkpoint.upload_rate)
        self._running = (index, at, ends)

    def _next_probe(self) -> float:
        """When the next probe goes: the first instant, after the last measurement, at
        which ``plan.probe_interval`` (the deadline known then) has passed since it; inf
        while an upload runs, or before any checkpoint was seen. Both inputs change only
        at a measurement (the schedule is fixed), so it is worked out once per one."""
        if not self._probes or self._running is not None or not self._sizes:
            return math.inf
        if self._probe_at is None:
            last = self._measured_at
            at = last + plan.PROBE_NEAR_SECONDS
            far = last + plan.PROBE_FAR_SECONDS
            estimate = plan.next_upload_seconds(self._sizes[::-1], self.rate(last))
            while at < far:
                deadline = self._known_deadline(at)
                remaining = None if deadline is None else deadline - at
                if plan.probe_interval(remaining, DEFAULT_UPLOAD_NEAR_RELEASE_SECONDS,
                                       estimate) <= at - last:
                    break
                at += plan.PROBE_NEAR_SECONDS
            self._probe_at = min(at, far)
        return self._probe_at

    def _send_probe(self, at: float) -> None:
        """A probe at ``at``: ``plan.PROBE_SECONDS`` worth at the rate assumed, through the
        link as it is then."""
        amount = plan.probe_amount(self.rate(at) or UPLOAD_RATE)
        link_rate = self._probe_rate(self.probe_count)
        self._probes_since.append(amount / (self._link.ends(at, amount, link_rate) - at))
        self.probe_count += 1
        self._measured_at, self._probe_at = at, None

    def advance(self, until: float) -> None:
        """Finish every upload that ends by ``until``, probing the link when it is due
        (``until`` inf: finish the uploads only, the run is over)."""
        while True:
            probe_at = math.inf if math.isinf(until) else self._next_probe()
            if self._running is None:
                if probe_at > until or math.isinf(probe_at):
                    return
                self._send_probe(probe_at)
                continue
            index, started, ends = self._running
            if ends > until:
                return
            self.durable[index] = ends
            amount = self.checkpoints[index].upload_seconds
            self._done.append((amount, ends - started))
            self._sizes.append(amount)
            self._running = None
            self._measured_at, self._probe_at = ends, None
            self._probes_since = []
            if self._waiting is not None:
                self._start(self._waiting, ends)
                self._waiting = None

    def measured(self) -> int:
        """How many uploads the estimate's rate rests on, as the daemon serves it
        (``upload_measured``): those done here, at most ``plan.RATE_WINDOW``."""
        return min(len(self._done), plan.RATE_WINDOW)

    def _left(self, now: float) -> float:
        """What the running upload still has to send at ``now`` (0: none runs)."""
        if self._running is None:
            return 0.0
        index, started, _ = self._running
        checkpoint = self.checkpoints[index]
        sent = self._link.sent(started, now, checkpoint.upload_rate)
        return max(0.0, checkpoint.upload_seconds - sent)

    def rate(self, now: float) -> Optional[float]:
        """The rate the daemon assumes at ``now``: the plan's over the recent uploads (the
        prior's before any), slower when the one in progress shows it."""
        rate = plan.throughput((self._done or self._prior)[-plan.RATE_WINDOW:], None)
        rate = plan.with_probe(rate, plan.probed_rate(self._probes_since))
        if self._running is None or rate is None:
            return UPLOAD_RATE if rate is None else rate
        index, started, _ = self._running
        left = self._left(now)
        return plan.in_progress_rate(rate, sent=self.checkpoints[index].upload_seconds - left,
                                     elapsed_seconds=now - started, left=left)

    def estimate(self, now: float) -> Optional[float]:
        """What the daemon serves at ``now`` as the next upload's duration."""
        self.advance(now)
        if not self._done:
            if plan.probed_rate(self._probes_since) is None:
                return self._first_estimate  # nothing measured here: the saved estimate
            # A probe, no upload yet: the saved estimate, longer when the link is slower.
            probed = plan.next_upload_seconds(self._sizes[::-1], self.rate(now))
            return max(self._first_estimate or 0.0, probed or 0.0) or None
        sizes = [amount for amount, _ in self._done[::-1]]
        return plan.next_upload_seconds(sizes, self.rate(now))

    def add(self, checkpoint: Checkpoint) -> None:
        """A checkpoint saved at ``checkpoint.saved_seconds``: upload it, or queue it."""
        now = checkpoint.saved_seconds
        self.advance(now)
        index = len(self.checkpoints)
        self.checkpoints.append(checkpoint)
        self.durable.append(math.inf)
        if checkpoint.upload_seconds <= 0:
            self.durable[index] = now
            return
        if self._running is None:
            self._start(index, now)
            self._probe_at = None
            return
        deadline = self._known_deadline(now)
        remaining = None if deadline is None else deadline - now
        next_upload = plan.next_upload_seconds(self._sizes[::-1], self.rate(now))
        if plan.gives_way(
            remaining, near_release_seconds=DEFAULT_UPLOAD_NEAR_RELEASE_SECONDS,
            next_upload=next_upload, current_left=self._left(now),
            newer=plan.largest_recent(self._sizes[::-1]) or 0.0, rate=self.rate(now),
        ):
            self._start(index, now)  # give the old one up
            self._waiting = None
        else:
            self._waiting = index


def durable_times(
    checkpoints: Sequence[Checkpoint],
    known_deadline: Callable[[float], Optional[float]],
    first_estimate: Optional[float],
    *,
    link: Link = FULL_SPEED,
    prior: Sequence[tuple[float, float]] = (),
) -> list[float]:
    """When each checkpoint became durable (``inf``: never, its upload was given up or
    skipped), by :class:`Uploads`."""
    uploads = Uploads(known_deadline, first_estimate, link=link, prior=prior)
    for checkpoint in checkpoints:
        uploads.add(checkpoint)
    uploads.advance(math.inf)
    return uploads.durable


def simulate_run(
    workload: Workload,
    policy: PolicyFactory,
    seed: int,
    *,
    notice_delay_seconds: float = DEFAULT_NOTICE_DELAY_SECONDS,
) -> RunOutcome:
    """Run one job until the reclaim (or the policy's exit) and account for it."""
    trace = workload.trace(seed)
    changes = trace.changes
    if workload.notice_delay_seconds is not None:
        notice_delay_seconds = workload.notice_delay_seconds
    known_at = [_known_from(change, notice_delay_seconds) for change in changes]
    reclaim_seconds, enforced = _reclaim(changes)
    learned_seconds = known_at[enforced]
    worst = workload.step_max_seconds + workload.save_max_seconds + workload.upload_max_seconds
    feasible = reclaim_seconds - learned_seconds >= worst
    window_opens = max(learned_seconds, reclaim_seconds - (worst + WINDOW_MARGIN_SECONDS))
    uploads = workload.upload_seconds > 0
    # The estimate the checkpoint carried from the machine before: its daemon's, over the
    # uploads it measured there.
    prior = trace.history(plan.RATE_WINDOW) if uploads else []
    first_estimate = (plan.next_upload_seconds([workload.upload_seconds],
                                               plan.throughput(prior, None))
                      if uploads else None)

    def known_deadline(now_seconds: float) -> Optional[float]:
        deadline = None
        for change, at in zip(changes, known_at):
            if at > now_seconds:
                break
            deadline = change.deadline_seconds
        return deadline

    agent = policy.make(RunInfo(trace=trace, reclaim_seconds=reclaim_seconds))
    queue = Uploads(known_deadline, first_estimate, link=trace.link, prior=prior,
                    probe_rate=trace.probe_rate)
    if isinstance(agent, SidecarPolicy):
        # The guard's state from the checkpoint: the saves measured before, if the
        # workload says so, and the previous uploader's estimate.
        agent.resume(trace.earlier_saves() if workload.measured_saves else [], first_estimate)
        agent.uploads_measured(queue.measured)
        agent.source_notice(workload.notice)  # what GET /v1/protection would serve
    now = 0.0
    saving = idle = 0.0
    steps = saves = window_saves = 0
    interrupted = False
    waiting = False
    trained: list[tuple[float, float]] = []  # (start, end) of every step, the cut one too
    queue.add(Checkpoint(0.0, 0.0, 0.0))  # the run resumes from a durable checkpoint

    def estimate() -> Optional[float]:
        return queue.estimate(now)  # what the daemon would serve now

    while True:
        if waiting:
            news = [at for at in known_at if now < at < reclaim_seconds]
            if not news:
                idle += reclaim_seconds - now
                break
            idle += news[0] - now
            now = news[0]
            waiting = agent.should_stop(now, known_deadline(now), estimate())
            continue
        step = trace.step_seconds(steps)
        if now + step >= reclaim_seconds:  # the step in progress is cut off
            trained.append((now, reclaim_seconds))
            break
        trained.append((now, now + step))
        now += step
        steps += 1
        agent.record_step(step)
        if agent.should_save(now, known_deadline(now), estimate()):
            seconds = trace.save_seconds(saves)
            window_saves += now + seconds >= window_opens
            if now + seconds > reclaim_seconds:  # a save in progress at the reclaim is lost
                saving += reclaim_seconds - now
                interrupted = True
                break
            agent.record_save(seconds, now)
            amount, rate = trace.upload(saves) if uploads else (0.0, 1.0)
            queue.add(Checkpoint(now, now + seconds, amount, rate))
            now += seconds
            saving += seconds
            saves += 1
        if agent.should_stop(now, known_deadline(now), estimate()):
            if not agent.waits:
                idle += reclaim_seconds - now
                break
            waiting = True
    queue.advance(math.inf)
    resumed = max((c for c, at in zip(queue.checkpoints, queue.durable)
                   if at <= reclaim_seconds),
                  key=lambda c: c.state_seconds)
    # The account the daemon and `esi-sidecar restore` keep too (sidecar.train.reclaim_cost).
    unsaved = redone_seconds(trained, resumed.state_seconds)
    return RunOutcome(
        workload=workload.name,
        policy=policy.name,
        seed=seed,
        reclaim_seconds=reclaim_seconds,
        learned_seconds=learned_seconds,
        feasible=feasible,
        missed=unsaved > 0 and resumed.saved_seconds < window_opens,
        lost_seconds=lost_seconds(reclaim_seconds, resumed.state_seconds),
        unsaved_seconds=unsaved,
        saves=saves,
        window_saves=window_saves,
        interrupted_save=interrupted,
        saving_seconds=saving,
        idle_seconds=idle,
        steps=steps,
    )


def summarize(outcomes: Sequence[RunOutcome]) -> Result:
    """Aggregate the runs of one (policy, workload) pair."""
    count = len(outcomes)
    lost = [o.lost_seconds for o in outcomes]
    return Result(
        workload=outcomes[0].workload,
        policy=outcomes[0].policy,
        runs=count,
        feasible_runs=sum(o.feasible for o in outcomes),
        misses=sum(o.missed and o.feasible for o in outcomes),
        infeasible_misses=sum(o.missed and not o.feasible for o in outcomes),
        lost_median_seconds=quantile(lost, 0.5),
        lost_mean_seconds=sum(lost) / count,
        lost_p95_seconds=quantile(lost, 0.95),
        lost_max_seconds=max(lost),
        unsaved_mean_seconds=sum(o.unsaved_seconds for o in outcomes) / count,
        saves_mean=sum(o.saves for o in outcomes) / count,
        window_saves_mean=sum(o.window_saves for o in outcomes) / count,
        window_saves_max=max(o.window_saves for o in outcomes),
        interrupted_saves=sum(o.interrupted_save for o in outcomes),
        saving_mean_seconds=sum(o.saving_seconds for o in outcomes) / count,
        idle_mean_seconds=sum(o.idle_seconds for o in outcomes) / count,
    )


def run(
    workloads: Optional[Sequence[Union[str, Workload]]] = None,
    policies: Optional[Sequence[Union[str, PolicyFactory]]] = None,
    seeds: int = 200,
    seed0: int = 0,
    *,
    notice_delay_seconds: float = DEFAULT_NOTICE_DELAY_SECONDS,
    progress: Optional[Callable[[float], None]] = None,
) -> list[Result]:
    """Simulate every (workload, policy) pair on seeds ``seed0 .. seed0 + seeds - 1``.

    Names or objects are accepted; None means all built-ins. Results come workload by
    workload, policies in the order given. ``progress`` is called with the done fraction.
    """
    if seeds < 1:
        raise ValueError(f"seeds must be >= 1, got {seeds}")
    chosen_workloads = [get_workload(w) if isinstance(w, str) else w
                        for w in (workloads if workloads is not None else list(WORKLOADS))]
    chosen_policies = [get_policy(p) if isinstance(p, str) else p
                       for p in (policies if policies is not None else list(POLICIES))]
    total = len(chosen_workloads) * len(chosen_policies)
    results = []
    # The real guard runs inside: its log lines (one per simulated deadline) are for
    # training jobs, not for a table of thousands of runs.
    guard_log = logging.getLogger("sidecar.train")
    level = guard_log.level
    guard_log.setLevel(logging.CRITICAL)
    try:
        for workload in chosen_workloads:
            for policy in chosen_policies:
                outcomes = [
                    simulate_run(workload, policy, seed,
                                 notice_delay_seconds=notice_delay_seconds)
                    for seed in range(seed0, seed0 + seeds)
                ]
                results.append(summarize(outcomes))
                if progress is not None:
                    progress(len(results) / total)
    finally:
        guard_log.setLevel(level)
    return results


def top_up_sweep(
    seeds: int = 200,
    seed0: int = 0,
    *,
    notice_delay_seconds: float = DEFAULT_NOTICE_DELAY_SECONDS,
    progress: Optional[Callable[[float], None]] = None,
) -> list[Result]:
    """The sidecar with each of ``TOP_UP_MARGINS``, and the oracle, on the reference
    workloads: the runs behind ``SavePolicy.top_up_seconds``'s default."""
    reference = [w for w in WORKLOADS.values() if not w.stress]
    policies = [POLICIES["oracle"], *(top_up_policy(m) for m in TOP_UP_MARGINS)]
    return run(reference, policies, seeds, seed0,
               notice_delay_seconds=notice_delay_seconds, progress=progress)
