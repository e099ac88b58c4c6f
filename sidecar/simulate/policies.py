"""The save policies compared by the simulator, behind one small per-step protocol.

The engine calls, after every training step and in this order, exactly what a training
loop with :class:`sidecar.client.CheckpointGuard` calls::

    record_step(step_s)                  # `with guard.step(): ...`
    if should_save(now, deadline):       # guard.should_save()
        record_save(save_s, started_s)   # `with guard.saving(): ...`
    if should_stop(now, deadline):       # guard.should_stop() -> break
        ...

``deadline`` is the deadline the job knows (None before one is known), on the same clock
as ``now`` (seconds since the run started).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

from sidecar.policy import PolicyDecision, SavePolicy

__all__ = [
    "POLICIES",
    "PeriodicPolicy",
    "Policy",
    "PolicyFactory",
    "SidecarPolicy",
    "SidecarWithPeriodicPolicy",
    "VerlPolicy",
    "get_policy",
]


class Policy(Protocol):
    def record_step(self, seconds: float) -> None: ...

    def should_save(self, now_s: float, deadline_s: Optional[float]) -> bool: ...

    def record_save(self, seconds: float, started_s: float) -> None: ...

    def should_stop(self, now_s: float, deadline_s: Optional[float]) -> bool: ...


class PeriodicPolicy:
    """Save when ``interval_s`` have passed since the last save started; never stop.

    The run starts from a checkpoint (a resumed job), so the first save is one interval
    in. Deadline-blind on purpose: this is the usual advice ("save every 15-60 min").
    """

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._last_save_started_s = 0.0

    def record_step(self, seconds: float) -> None:
        pass

    def should_save(self, now_s: float, deadline_s: Optional[float]) -> bool:
        return now_s - self._last_save_started_s >= self.interval_s

    def record_save(self, seconds: float, started_s: float) -> None:
        self._last_save_started_s = started_s

    def should_stop(self, now_s: float, deadline_s: Optional[float]) -> bool:
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

    def __init__(
        self, redundant_s: float = 120.0, save_freq: int = 10**9, save_estimate_s: float = 60.0
    ) -> None:
        self.redundant_s = redundant_s
        self.save_freq = save_freq
        self.save_estimate_s = save_estimate_s
        self.max_steps_duration = 0.0
        self.global_steps = 0
        self._this_step_s = 0.0

    def close_to_expiration(self, now_s: float, deadline_s: Optional[float]) -> bool:
        """``should_save_ckpt_esi``: the deadline check, without the ``save_freq`` gate."""
        if deadline_s is None:
            return False
        remaining = deadline_s - now_s
        return (
            remaining > 0
            and self.max_steps_duration > 0
            and remaining <= self.save_estimate_s + self.max_steps_duration + self.redundant_s
        )

    def record_step(self, seconds: float) -> None:
        self.global_steps += 1
        self._this_step_s = seconds

    def should_save(self, now_s: float, deadline_s: Optional[float]) -> bool:
        esi = self.close_to_expiration(now_s, deadline_s)
        return self.save_freq > 0 and (self.global_steps % self.save_freq == 0 or esi)

    def record_save(self, seconds: float, started_s: float) -> None:
        self._this_step_s += seconds

    def should_stop(self, now_s: float, deadline_s: Optional[float]) -> bool:
        # End of verl's step: only now does this step's time (save included) count.
        self.max_steps_duration = max(self.max_steps_duration, self._this_step_s)
        return False


class SidecarPolicy:
    """This project's policy: the real :class:`sidecar.policy.SavePolicy`, driven as the guard.

    Mirrors ``CheckpointGuard`` for one process without a reducer: both questions go to
    ``SavePolicy.evaluate`` (what the guard's ``_decide`` computes from the same policy
    state), and ``record_save`` passes the budget of the last "save now?" decision and
    the deadline known then (the guard passes the deadline of its last decision).
    """

    def __init__(self, **options: Any) -> None:
        self.policy = SavePolicy(**options)
        self.last_decision: Optional[PolicyDecision] = None
        self.last_save_decision: Optional[PolicyDecision] = None
        self.decided_deadline_s: Optional[float] = None

    def record_step(self, seconds: float) -> None:
        self.policy.record_step(seconds)

    def should_save(self, now_s: float, deadline_s: Optional[float]) -> bool:
        self.last_decision = self.last_save_decision = self.policy.evaluate(now_s, deadline_s)
        self.decided_deadline_s = deadline_s
        return self.last_decision.save_now

    def record_save(self, seconds: float, started_s: float) -> None:
        asked = self.last_save_decision
        budget = None if asked is None else asked.budget_seconds
        self.policy.record_save(seconds, started_unix=started_s,
                                deadline_unix=self.decided_deadline_s, budget_seconds=budget)

    def should_stop(self, now_s: float, deadline_s: Optional[float]) -> bool:
        self.last_decision = self.policy.evaluate(now_s, deadline_s)
        self.decided_deadline_s = deadline_s
        return self.last_decision.stop


class SidecarWithPeriodicPolicy(SidecarPolicy):
    """The sidecar plus the user's own periodic saves, all inside ``guard.saving()``.

    The usual deployment: periodic saves bound the loss when no deadline is ever known
    in time, and, being measured by the guard, they teach the policy the real save time
    before the final save. A periodic save counts as the final save only when the
    deadline was known and inside the rule's window when it started; otherwise a
    deadline learned after it still gets its own save.
    """

    def __init__(self, interval_s: float, **options: Any) -> None:
        super().__init__(**options)
        self.periodic = PeriodicPolicy(interval_s)

    def should_save(self, now_s: float, deadline_s: Optional[float]) -> bool:
        deadline_save = super().should_save(now_s, deadline_s)
        return self.periodic.should_save(now_s, deadline_s) or deadline_save

    def record_save(self, seconds: float, started_s: float) -> None:
        super().record_save(seconds, started_s)
        self.periodic.record_save(seconds, started_s)


@dataclass(frozen=True)
class PolicyFactory:
    """A named recipe: each simulated run gets a fresh policy from ``make``."""

    name: str
    description: str
    make: Callable[[], Policy]


POLICIES: dict[str, PolicyFactory] = {
    p.name: p
    for p in (
        PolicyFactory("periodic-15", "save every 15 min, deadline-blind",
                      lambda: PeriodicPolicy(15 * 60.0)),
        PolicyFactory("periodic-30", "save every 30 min, deadline-blind",
                      lambda: PeriodicPolicy(30 * 60.0)),
        PolicyFactory("periodic-60", "save every 60 min, deadline-blind",
                      lambda: PeriodicPolicy(60 * 60.0)),
        PolicyFactory("verl", "verl's ESI rule, esi_redundant_time=120 s as the ESI guide sets it",
                      lambda: VerlPolicy(redundant_s=120.0)),
        PolicyFactory("verl-r0", "verl's ESI rule with verl's default esi_redundant_time=0",
                      lambda: VerlPolicy(redundant_s=0.0)),
        PolicyFactory("sidecar", "sidecar.policy.SavePolicy defaults (max of 100 steps, "
                      "measured saves x1.2, 120 s margin), once per deadline, then stop",
                      SidecarPolicy),
        PolicyFactory("sidecar+periodic-30", "the sidecar plus a save every 30 min, all measured "
                      "by the guard; a periodic save is the final one only if the deadline was "
                      "known and inside the window when it started",
                      lambda: SidecarWithPeriodicPolicy(30 * 60.0)),
    )
}


def get_policy(name: str) -> PolicyFactory:
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}") from None
