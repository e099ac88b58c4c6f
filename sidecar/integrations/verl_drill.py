"""The fire drill for verl's stateless drop-in (``should_save_ckpt_esi``): verl saves for a
drill deadline through its own ``_save_checkpoint``, trains on, and the drill is reported.

Standard library only. verl calls the drop-in once per step and saves right after a True;
it never says which step nor when the save ended. So: True once per drill, when verl's rule
holds against the drill's deadline (docs/drill.md), and the next call, one step later, is
where the save has ended. Without an uploader the local save counts, so the checkpoint is
durable by then (an upper bound: the step in between is counted as part of the save); with
one it is durable once the daemon's ``last_durable_step`` moves past the one known at the
answer. Then one ``"drill"`` job event, as a guard sends it. The drop-in also sends its
step estimate (every 30 s, as a guard does), without which the daemon refuses a drill ("no
job answers"). A real deadline is verl's rule as ever: when it is the earlier, verl saves
for it anyway.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Optional

from sidecar.train.deadline import DeadlineTracker
from sidecar.train.job_events import ESTIMATE_EVENT_SECONDS, JobEvents
from sidecar.train.policy import verl_rule

__all__ = ["VerlDrill"]

logger = logging.getLogger("sidecar.integrations.verl")

_DONE_KEPT = 16  # drill ids remembered as done


@dataclass
class _Asked:
    """A True answered for a drill: verl saves right after it."""

    id: str
    deadline_unix: float
    asked_unix: float
    budget_seconds: float
    step_seconds: float
    durable_before: Optional[int]  # the uploader's last durable step at the answer
    saved_unix: Optional[float] = None  # the next call: the save has ended by then


class VerlDrill:
    """The drill the drop-in follows for one :class:`DeadlineTracker` (thread-safe)."""

    def __init__(self, tracker: DeadlineTracker) -> None:
        self.tracker = self._tracker = tracker
        self._events = JobEvents(tracker.client, enabled=True, job=None,
                                 clock=tracker.clock, monotonic=time.monotonic)
        self._lock = threading.Lock()
        self._asked: Optional[_Asked] = None
        self._done: deque[str] = deque(maxlen=_DONE_KEPT)
        self._next_estimate = -math.inf
        self._next_durable_check = -math.inf

    def answer(self, step_seconds: float, save_seconds: float,
               redundant_seconds: float) -> bool:
        """True when verl should save now for the drill under way (once per drill)."""
        now = self._tracker.clock()
        budget = step_seconds + save_seconds + redundant_seconds
        drill = self._tracker.drill
        with self._lock:
            self._estimate(step_seconds, save_seconds, budget, now)
            if self._asked is not None:
                self._follow(now)
            if drill is None or self._asked is not None:
                return False
            identity = str(drill.get("id"))
            deadline = float(drill["expires_at_unix"])  # type: ignore[arg-type]  # models
            if identity in self._done:
                return False
            if now >= deadline:
                self._report(identity, "no-save", reason="no save was asked for before the "
                             "drill deadline", remaining=deadline - now)
                return False
            if not verl_rule(deadline - now, step_seconds, save_seconds, redundant_seconds):
                return False
            uploads = self._tracker.upload_status is not None
            self._asked = _Asked(identity, deadline, now, budget, step_seconds,
                                 self._tracker.client.last_durable_step() if uploads else None)
            logger.info("fire drill %s: verl saves now for the drill deadline in %.0f s; "
                        "then training goes on", identity, deadline - now)
            return True

    def _estimate(self, step: float, save: float, budget: float, now: float) -> None:
        if step > 0 and time.monotonic() >= self._next_estimate:
            self._next_estimate = time.monotonic() + ESTIMATE_EVENT_SECONDS
            deadline, _source = self._tracker.deadline(refresh=False)
            self._events.send("step-estimate", step_seconds=step, save_seconds=save,
                              budget_seconds=budget,
                              remaining_seconds=None if deadline is None else deadline - now)

    def _follow(self, now: float) -> None:
        asked = self._asked
        assert asked is not None
        if asked.saved_unix is None:
            asked.saved_unix = now  # verl's save ran between the answer and this call
        if self._tracker.upload_status is None:
            self._durable(asked, now)
        elif time.monotonic() >= self._next_durable_check:
            self._next_durable_check = time.monotonic() + 1.0
            step = self._tracker.client.last_durable_step()
            if step is not None and (asked.durable_before is None or step > asked.durable_before):
                self._durable(asked, now)
                return
        if self._asked is not None and now >= asked.deadline_unix:
            self._asked = None
            self._report(asked.id, "not-durable", budget=asked.budget_seconds,
                         remaining=asked.deadline_unix - asked.asked_unix,
                         save=self._save_seconds(asked),
                         reason=f"upload {self._tracker.upload_status or 'none'}")

    def _save_seconds(self, asked: _Asked) -> float:
        saved = asked.saved_unix if asked.saved_unix is not None else asked.asked_unix
        return max(0.0, saved - asked.asked_unix - asked.step_seconds)

    def _durable(self, asked: _Asked, now: float) -> None:
        self._asked = None
        save = self._save_seconds(asked)
        late = now - asked.deadline_unix  # durable after the drill deadline: not in time
        self._report(asked.id, "durable" if late <= 0 else "not-durable",
                     reason=None if late <= 0 else f"durable {late:.1f} s after the drill "
                     "deadline", budget=asked.budget_seconds,
                     remaining=asked.deadline_unix - asked.asked_unix, save=save,
                     upload=max(0.0, now - asked.asked_unix - save),
                     durable=now - asked.asked_unix, lead=asked.deadline_unix - now)

    def _report(self, identity: str, outcome: str, *, reason: Optional[str] = None,
                budget: Optional[float] = None, remaining: Optional[float] = None,
                save: Optional[float] = None, upload: Optional[float] = None,
                durable: Optional[float] = None, lead: Optional[float] = None) -> None:
        self._done.append(identity)
        figures = {"id": identity, "outcome": outcome, "budget_seconds": budget,
                   "save_seconds": save, "upload_seconds": upload, "durable_seconds": durable,
                   "lead_seconds": lead, "remaining_seconds": remaining}
        self._events.send("drill", reason=reason,
                          drill={k: v for k, v in figures.items() if v is not None})
        if outcome == "durable":
            logger.info("fire drill %s: verl's checkpoint durable %.1f s before the drill "
                        "deadline; training goes on", identity, lead)
        else:
            logger.warning("fire drill %s: %s%s; training goes on", identity, outcome,
                           f" ({reason})" if reason else "")
