"""The discrete-event loop: one job, one deadline schedule, one policy; no sleeping.

Time is a float (seconds since the run started) advanced by drawn durations, so a two
hour run costs a few hundred loop turns. The definitions below are the ones
docs/simulation.md states; keep the two in step.

- The machine is reclaimed at the first instant the true deadline is reached.
- A deadline change reaches the job ``notice_delay_seconds`` after it happened (the daemon
  serves it after its next poll); the deadline known at the start is known at once.
- ``lead``: reclaim time minus the time the job learned the deadline that was enforced.
  A run is *feasible* when ``lead >= step_max + save_max``: even from the worst point
  (a worst-case step just started) one more step and one save fit.
- The *final window* opens at the later of that learning time and ``W`` before the
  reclaim, ``W = step_max + save_max + 120 s`` (the seed rule's budget with the workload's
  worst step and save, and the guide's margin).
- A run *misses* when, at the reclaim, training was done since the newest completed
  checkpoint and that checkpoint was finished before the final window opened.
- *Lost* work: training time (whole and cut steps) since the newest completed checkpoint.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Callable, Optional, Union

from sidecar.tools.simulate.policies import POLICIES, PolicyFactory, get_policy
from sidecar.tools.simulate.workloads import WORKLOADS, DeadlineChange, Workload, get_workload
from sidecar.train.policy import quantile

__all__ = [
    "DEFAULT_NOTICE_DELAY_SECONDS",
    "WINDOW_MARGIN_SECONDS",
    "Result",
    "RunOutcome",
    "run",
    "simulate_run",
]

DEFAULT_NOTICE_DELAY_SECONDS = 30.0  # one poll interval of the daemon (its default)
WINDOW_MARGIN_SECONDS = 120.0  # the ESI guide's redundant time, used to size the final window


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
    lost_seconds: float  # training time since the newest completed checkpoint
    saves: int  # completed saves
    window_saves: int  # saves ending inside the final window (one cut by the reclaim too)
    interrupted_save: bool  # a save was in progress at the reclaim
    saving_seconds: float  # time spent saving, the interrupted save included
    idle_seconds: float  # time between the policy's stop and the reclaim
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
    lost_mean_seconds: float
    lost_p95_seconds: float
    lost_max_seconds: float
    saves_mean: float
    window_saves_mean: float
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
    """Run one job until the reclaim (or the policy's stop) and account for it."""
    trace = workload.trace(seed)
    changes = trace.changes
    known_at = [_known_from(change, notice_delay_seconds) for change in changes]
    reclaim_seconds, enforced = _reclaim(changes)
    learned_seconds = known_at[enforced]
    worst = workload.step_max_seconds + workload.save_max_seconds
    feasible = reclaim_seconds - learned_seconds >= worst
    window_opens = max(learned_seconds, reclaim_seconds - (worst + WINDOW_MARGIN_SECONDS))

    def known_deadline(now_seconds: float) -> Optional[float]:
        deadline = None
        for change, at in zip(changes, known_at):
            if at > now_seconds:
                break
            deadline = change.deadline_seconds
        return deadline

    agent = policy.make()
    now = 0.0
    checkpoint_seconds = 0.0  # the run resumes from a checkpoint made at its start
    lost = saving = idle = 0.0
    steps = saves = window_saves = 0
    interrupted = False
    while True:
        step = trace.step_seconds(steps)
        if now + step >= reclaim_seconds:  # the step in progress is cut off
            lost += reclaim_seconds - now
            break
        now += step
        lost += step
        steps += 1
        agent.record_step(step)
        if agent.should_save(now, known_deadline(now)):
            seconds = trace.save_seconds(saves)
            window_saves += now + seconds >= window_opens
            if now + seconds > reclaim_seconds:  # a save in progress at the reclaim is lost
                saving += reclaim_seconds - now
                interrupted = True
                break
            agent.record_save(seconds, now)
            now += seconds
            saving += seconds
            saves += 1
            checkpoint_seconds = now
            lost = 0.0
        if agent.should_stop(now, known_deadline(now)):
            idle = reclaim_seconds - now
            break
    return RunOutcome(
        workload=workload.name,
        policy=policy.name,
        seed=seed,
        reclaim_seconds=reclaim_seconds,
        learned_seconds=learned_seconds,
        feasible=feasible,
        missed=lost > 0 and checkpoint_seconds < window_opens,
        lost_seconds=lost,
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
        lost_mean_seconds=sum(lost) / count,
        lost_p95_seconds=quantile(lost, 0.95),
        lost_max_seconds=max(lost),
        saves_mean=sum(o.saves for o in outcomes) / count,
        window_saves_mean=sum(o.window_saves for o in outcomes) / count,
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
    for workload in chosen_workloads:
        for policy in chosen_policies:
            outcomes = [
                simulate_run(workload, policy, seed, notice_delay_seconds=notice_delay_seconds)
                for seed in range(seed0, seed0 + seeds)
            ]
            results.append(summarize(outcomes))
            if progress is not None:
                progress(len(results) / total)
    return results
