"""Routine saves where no notice can hold a save: whether, how often, and what a reclaim costs.

Standard library only, no I/O, every time passed in or read from an injected clock. When
a running source's notice (AWS spot 2 min, GCP and Azure 30 s, Volcengine spot 5 min, a
SIGTERM grace) is shorter than the job's step + save + upload (the protection verdict,
``sidecar.train.protection``), the final save cannot be made in time: the only defence is
a recent checkpoint. The interval is Young's (J. W. Young, "A first order approximation
to the optimum checkpoint interval", CACM 17(9), 1974; J. T. Daly's higher-order form,
FGCS 22(3), 2006, differs by under 2 % while the save is under a thousandth of the time
between reclaims)::

    interval = sqrt(2 x save cost x mean time between reclaims)

*Save cost* is the GPU time a save takes from training: the blocking save the guard
measures (``SavePolicy.save_estimate()``, x1.2 included). The upload is not counted: the
daemon's uploader runs beside training and costs it nothing (it only delays when the
checkpoint is durable, which shifts the expected loss, not the optimum, to first order).
The mean time between reclaims is :data:`DEFAULT_RECLAIM_EVERY_SECONDS` for the source,
or, once the daemon saw releases itself (``releases_seen`` in ``GET /v1/reclaims``; never
the posted accounts), the measured one (:func:`measured_reclaim_every`). Several exposed
sources add their rates.

The automatic interval has a floor, :func:`routine_floor_seconds`: at least
:data:`FLOOR_SAVES` x the save and at least :data:`FLOOR_SECONDS`. Young's form is a first
order approximation in save / interval; a save measured at nearly 0 s (a write into the page
cache, the blocking part of an asynchronous save) gives an interval near 0, a save every
step. Ten saves per interval caps what routine saves take from training at 10 % of its
time, where the first-order form still holds (it binds only when a reclaim is expected
within 50 saves). Five minutes covers what the save cost leaves out: the upload it starts
(checkpoints coming faster than the uploader sends them only queue), the I/O a save takes
from the data loader, and a measured save that is shorter than the next one will be. Either
bound loses little where it binds: with the interval r x the optimum, the expected waste is
(r + 1 / r) / 2 x its least (1.25 x at r = 2). A number given as ``routine_seconds`` is
the user's choice and is kept as it is.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Callable, Optional, Protocol, Union

from sidecar.train.estimates import (
    DEFAULT_RECLAIM_EVERY_SECONDS,
    FALLBACK_RECLAIM_EVERY_SECONDS,
    FLOOR_SAVES,
    FLOOR_SECONDS,
    measured_reclaim_every,
    reclaim_every,
    routine_floor_seconds,
    young_daly_seconds,
)
from sidecar.train.protection import DurableCheckpoint, JobFigures, Verdict, judge, short_duration

__all__ = [
    "AUTO",
    "DEFAULT_RECLAIM_EVERY_SECONDS",
    "FALLBACK_RECLAIM_EVERY_SECONDS",
    "FLOOR_SAVES",
    "FLOOR_SECONDS",
    "RoutinePlan",
    "RoutineSaves",
    "check_routine",
    "daemon_asker",
    "measured_reclaim_every",
    "plan_routine",
    "reclaim_every",
    "routine_floor_seconds",
    "young_daly_seconds",
]

AUTO = "auto"

# How each source's reclaim reads in the line the guard says.
_NAMED = {
    "aws": "an AWS spot interruption",
    "gcp": "a GCP preemption",
    "azure": "an Azure eviction",
    "volcengine-spot": "a Volcengine spot reclaim",
    "volcengine-events": "a Volcengine spot reclaim",
    "SIGTERM": "a SIGTERM",
}

Setting = Union[str, float, None]


class _Graced(Protocol):
    grace_seconds: float


def check_routine(value: object) -> Setting:
    """``"auto"``, a number of seconds > 0, or None; ValueError naming ``routine_seconds``."""
    if value is None or value == AUTO:
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            math.isfinite(value) and value > 0):
        raise ValueError(f"routine_seconds must be 'auto', a number of seconds > 0 or None, "
                         f"got {value!r}")
    return float(value)


@dataclass(frozen=True)
class RoutinePlan:
    """Routine saves now: the interval (None: none), and why."""

    interval_seconds: Optional[float]
    exposed: tuple[Verdict, ...]  # the sources whose notice cannot hold a save
    save_seconds: Optional[float]  # the save cost counted
    reclaim_every_seconds: Optional[float]
    measured_reclaims: int  # releases behind reclaim_every_seconds (0: the default)
    line: str  # what a reclaim costs now, said once per change

    @property
    def engaged(self) -> bool:
        return self.interval_seconds is not None


def _named(source: str) -> str:
    return _NAMED.get(source, f"a {source} notice")


def plan_routine(setting: Setting, notices: Mapping[str, Optional[float]], job: JobFigures,
                 *, machine_seconds: Sequence[float] = (),
                 durable: Optional[DurableCheckpoint] = None, now: float = 0.0) -> RoutinePlan:
    """The plan for ``setting`` (``"auto"``, seconds, None) against each source's notice."""
    verdicts = judge(notices, job, durable, now)
    exposed = tuple(v for v in verdicts if v.protected is False)
    save = job.save_seconds
    if setting is None or (setting == AUTO and (not exposed or save is None)):
        held = "; ".join(v.reason for v in verdicts)
        return RoutinePlan(None, exposed, save, None, 0, f"no routine saves: {held}" if held
                           else "no routine saves: no source with a short notice")
    prior = reclaim_every([v.source for v in exposed])
    measured = measured_reclaim_every(machine_seconds, prior)
    every = prior if measured is None else measured
    counted = 0 if measured is None else len([s for s in machine_seconds if s > 0])
    if isinstance(setting, float):
        interval, how = setting, "routine_seconds"
    else:
        assert save is not None
        interval = young_daly_seconds(save, every)
        how = (f"Young/Daly: a {short_duration(save)} save, a reclaim every "
               f"{short_duration(every)} " + (f"measured over {counted} release"
                                              f"{'s' if counted > 1 else ''}" if counted
                                              else "assumed"))
        floor = routine_floor_seconds(save)
        if interval < floor:
            interval = floor
            how += (f"; the floor: {FLOOR_SAVES:g} x the save, at least "
                    f"{short_duration(FLOOR_SECONDS)}")
    if exposed:
        worst = min(exposed, key=lambda v: v.notice_seconds or 0.0)
        needed = worst.needed_seconds or 0.0
        what = "step + save + upload" if job.upload_seconds else "step + save"
        said = (f"{_named(worst.source)} gives {short_duration(worst.notice_seconds or 0.0)}; "
                f"a {what} takes {short_duration(needed)}; ")
    else:
        needed = job.needed_seconds or 0.0
        said = ""
    now_part = ""
    if exposed and exposed[0].at_risk_seconds is not None:
        step = exposed[0].at_risk_step
        now_part = (f" (now {short_duration(exposed[0].at_risk_seconds)}"
                    + ("" if step is None else f", since step {step}") + ")")
    line = (f"{said}a reclaim loses up to {short_duration(interval + needed)}{now_part}, "
            f"routine saves every {short_duration(interval)} ({how})")
    return RoutinePlan(interval, exposed, save, every, counted, line)


class RoutineSaves:
    """When the next routine save is due, for a guard or a drop-in (clock injected).

    ``notices`` and ``machine_lives`` are asked at most once per ``ask_every_seconds`` (on
    ``monotonic``): the running sources' notices (source -> seconds, None: known ahead;
    None when unknown) and the lives of the reclaimed machines. The interval counts from
    the start of the last save of any kind (routine, final, the user's own), else from the
    first question. Says each new plan once, on ``logger``.
    """

    def __init__(self, setting: Setting, logger: logging.Logger, *,
                 monotonic: Callable[[], float],
                 notices: Callable[[], Optional[Mapping[str, Optional[float]]]],
                 machine_lives: Callable[[], Optional[Sequence[float]]] = lambda: None,
                 ask_every_seconds: float = 60.0) -> None:
        self.setting = check_routine(setting)
        self._logger = logger
        self._monotonic = monotonic
        self._ask_notices = notices
        self._ask_lives = machine_lives
        self._ask_every = ask_every_seconds
        self._asked_at: Optional[float] = None
        self._notices: dict[str, Optional[float]] = {}
        self._lives: Sequence[float] = ()
        self._since_unix: Optional[float] = None
        self._said: Optional[tuple[object, ...]] = None
        self.plan: Optional[RoutinePlan] = None

    @classmethod
    def asking(cls, tracker: object, setting: Setting, logger: logging.Logger,
               monotonic: Callable[[], float]) -> RoutineSaves:
        """Asking the :class:`~sidecar.train.deadline.DeadlineTracker`'s client
        (:meth:`~SidecarClient.source_notices`, :meth:`~SidecarClient.machine_lives`), and
        only while its daemon answers, so a hung daemon costs no more timeouts than it
        does already (a stand-in client without them: no notices)."""
        client = getattr(tracker, "client", None)

        def while_reachable(name: str) -> Callable[[], object]:
            ask = daemon_asker(client, name)
            return lambda: ask() if getattr(tracker, "reachable", False) else None

        return cls(setting, logger, monotonic=monotonic,
                   notices=while_reachable("source_notices"),  # type: ignore[arg-type]
                   machine_lives=while_reachable("machine_lives"))  # type: ignore[arg-type]

    def saved(self, started_unix: float) -> None:
        """A save (of any kind) started at ``started_unix``: the interval restarts."""
        self._since_unix = started_unix

    def _ask(self, extra: Mapping[str, Optional[float]]) -> None:
        now = self._monotonic()
        if self._asked_at is not None and now - self._asked_at < self._ask_every:
            return
        self._asked_at = now
        try:
            notices = self._ask_notices()
            if notices is not None:
                self._notices = dict(notices)
            if self.plan is not None and (self.plan.exposed or isinstance(self.setting, float)):
                lives = self._ask_lives()
                if lives is not None:
                    self._lives = list(lives)
        except Exception:  # a bug of ours or the daemon's must not stop training
            self._logger.debug("routine saves: could not ask the daemon", exc_info=True)
        self._notices.update(extra)

    def overdue(self, now_unix: float, job: JobFigures, sigterm: Optional[_Graced] = None,
                durable: Optional[DurableCheckpoint] = None) -> Optional[float]:
        """Seconds past due (negative: not yet); None: no routine saves now. ``sigterm``:
        the guard's SIGTERM deadline, whose grace is a notice too."""
        if self.setting is None:
            return None
        if self._since_unix is None:
            self._since_unix = now_unix
        self._ask({} if sigterm is None else {"SIGTERM": sigterm.grace_seconds})
        plan = self.plan = plan_routine(self.setting, self._notices, job,
                                        machine_seconds=self._lives, durable=durable,
                                        now=now_unix)
        key = (tuple((v.source, v.notice_seconds) for v in plan.exposed),
               None if plan.interval_seconds is None else round(plan.interval_seconds / 60),
               plan.measured_reclaims)
        if key != self._said:
            if plan.engaged or self._said is not None:
                self._logger.log(logging.WARNING if plan.exposed else logging.INFO, "%s",
                                 plan.line)
            self._said = key
        if plan.interval_seconds is None:
            return None
        return now_unix - (self._since_unix + plan.interval_seconds)


def daemon_asker(client: object, name: str) -> Callable[[], object]:
    """``client.name`` (a :class:`SidecarClient` method), or an answer of None for a
    stand-in client without it (a test's, the simulator's)."""
    asked = getattr(client, name, None)
    return asked if callable(asked) else lambda: None
