"""The discrete-event loop: one job, one deadline schedule, one policy; no sleeping.

Time is a float (seconds since the run started) advanced by drawn durations, so a two
hour run costs a few hundred loop turns. The definitions below are the ones
docs/simulation.md states; keep the two in step.

- The machine is reclaimed at the first instant the true deadline is reached; its local
  disk goes with it. A checkpoint counts only once it is *durable*: at once without an
  uploader, else when its commit ended (see :class:`Uploads` in ``uploads``, the daemon's
  uploader in a few lines: one thread, which streams a save's files while they are
  written when it is free, so durable = max(save end, stream start + upload) + the
  commit's tail; a checkpoint saved while another uploads waits for it, newest first,
  unless near the release the running one gives way to it as ``plan.gives_way`` says;
  the estimate served is the daemon's own, ``plan.estimate_seconds``, the upload in
  progress included). The link may slow (the workload's ``link_halves``); while the
  thread is free and no save runs the daemon probes it as ``plan.probe_interval`` says
  (a probe takes no time from the uploads here: it sends ``plan.PROBE_SECONDS`` of
  bytes, and the link is idle). The first estimate is the one the checkpoint carried
  from the machine before: its daemon's, over ``plan.RATE_WINDOW`` uploads it streamed.
- A deadline change reaches the job ``notice_delay_seconds`` after it happened (the daemon
  serves it after its next poll); the deadline known at the start is known at once.
- ``lead``: reclaim time minus the time the job learned the deadline that was enforced.
  A run is *feasible* when ``lead >= step_max + durable_max`` (``Workload``'s: the longer
  of the longest save and upload, then the commit): even from the worst point (a
  worst-case step just started) one more step, one save and its upload fit.
- The *final window* opens at the later of that learning time and ``W`` before the
  reclaim, ``W = step_max + durable_max + 120 s`` (the seed rule's budget with the
  workload's worst step, save and upload, and the guide's margin).
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

from sidecar.host.upload import plan
from sidecar.tools.simulate.policies import (
    POLICIES,
    PolicyFactory,
    RunInfo,
    SidecarPolicy,
    get_policy,
    top_up_policy,
)
from sidecar.tools.simulate.uploads import (
    Checkpoint,
    Uploads,
    durable_times,
    saved_estimate,
    streamed,
)
from sidecar.tools.simulate.workloads import (
    COMMIT_TAIL_SECONDS,
    WORKLOADS,
    DeadlineChange,
    Workload,
    get_workload,
)
from sidecar.train.policy import quantile
from sidecar.train.reclaim_cost import lost_seconds, redone_seconds

__all__ = [
    "COMMIT_TAIL_SECONDS",
    "DEFAULT_NOTICE_DELAY_SECONDS",
    "WINDOW_MARGIN_SECONDS",
    "Checkpoint",
    "Result",
    "RunOutcome",
    "Uploads",
    "durable_times",
    "run",
    "simulate_run",
    "top_up_sweep",
]

DEFAULT_NOTICE_DELAY_SECONDS = 30.0  # one poll interval of the daemon (its default)
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


def _known_from(change: DeadlineChange, notice_delay_seconds: float) -> float:
    return 0.0 if change.at_seconds <= 0 else change.at_seconds + notice_delay_seconds


def _reclaim(changes: Sequence[DeadlineChange]) -> tuple[float, int]:
    """The reclaim instant and the index of the change that set the enforced deadline."""
    for index, change in enumerate(changes):
        ends = changes[index + 1].at_seconds if index + 1 < len(changes) else math.inf
        if change.deadline_seconds is not None and change.deadline_seconds < ends:
            return max(change.deadline_seconds, change.at_seconds), index
    raise ValueError("the schedule never reclaims the machine")


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
    worst = workload.step_max_seconds + workload.durable_max_seconds
    feasible = reclaim_seconds - learned_seconds >= worst
    window_opens = max(learned_seconds, reclaim_seconds - (worst + WINDOW_MARGIN_SECONDS))
    uploads = workload.upload_seconds > 0
    prior = streamed(trace.history(plan.RATE_WINDOW)) if uploads else []
    first_estimate = saved_estimate(prior, workload.save_seconds) if uploads else None

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
