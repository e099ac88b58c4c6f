"""The fire drill's state on the daemon: one drill at a time, its refusals, its verdict.

A drill (``esi-sidecar drill``, ``POST /v1/drill``, docs/drill.md) is a deadline served to
the job as ``/v1/expiry``'s ``drill`` object, never as its ``expires_at``: a guard that
knows drills saves for it as for a release and trains on; one that does not ignores it.
The verdict comes from the guard's ``"drill"`` job event (:class:`DrillReport`), or, when
none came by the drill deadline plus a grace, is "no answer". Kept in memory only: a
daemon restarted mid-drill serves no drill (the job events keep the guard's reports).

Pure but for the lock: the clock and the real deadline are passed in, so the tests and
the API drive it alike.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Optional

from sidecar.host.features.events import DrillReport

__all__ = [
    "DEFAULT_GRACE_SECONDS",
    "JOB_SILENT_SECONDS",
    "MAX_LEAD_SECONDS",
    "MIN_LEAD_SECONDS",
    "RESULTS",
    "Drill",
    "DrillBoard",
    "DrillRefused",
    "default_lead",
]

MIN_LEAD_SECONDS = 1.0
MAX_LEAD_SECONDS = 86400.0  # a day: a drill is a rehearsal, not a schedule
# After the drill deadline, how long a guard has to report before the verdict is "no
# answer": a guard notices the deadline at its next step, a save at most one step late.
DEFAULT_GRACE_SECONDS = 30.0
# A job is there when it sent an event this recently: a guard sends its step estimate
# every 30 s (sidecar.train.job_events.ESTIMATE_EVENT_SECONDS).
JOB_SILENT_SECONDS = 90.0
RESULTS = ("pass", "fail", "no-answer", "called-off")
HISTORY = 20


class DrillRefused(Exception):
    """A drill not started: the HTTP status, a short code and one line saying why."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


@dataclass
class Drill:
    """One drill and, once known, its verdict."""

    id: str
    started_at_unix: float
    expires_at_unix: float
    lead_seconds: float
    grace_seconds: float
    result: Optional[str] = None  # one of RESULTS
    reason: Optional[str] = None
    decided_at_unix: Optional[float] = None
    report: dict[str, Any] = field(default_factory=dict)  # the guard's figures, job, rank

    def state(self, now: float) -> str:
        if self.result is not None:
            return "decided"
        return "running" if now < self.expires_at_unix else "waiting"

    def served(self, now: float) -> Optional[dict[str, Any]]:
        """``/v1/expiry``'s ``drill`` object while the drill's deadline is ahead."""
        if self.result == "called-off" or now >= self.expires_at_unix:
            return None
        return {"id": self.id, "expires_at": _rfc3339(self.expires_at_unix),
                "expires_at_unix": self.expires_at_unix,
                "remaining_seconds": self.expires_at_unix - now,
                "started_at_unix": self.started_at_unix}

    def to_json(self, now: float) -> dict[str, Any]:
        verdict = None if self.result is None else ("PASS" if self.result == "pass" else "FAIL")
        return {"id": self.id, "state": self.state(now), "verdict": verdict,
                "result": self.result, "reason": self.reason,
                "started_at_unix": self.started_at_unix,
                "expires_at": _rfc3339(self.expires_at_unix),
                "expires_at_unix": self.expires_at_unix, "lead_seconds": self.lead_seconds,
                "remaining_seconds": self.expires_at_unix - now,
                "grace_seconds": self.grace_seconds, "decided_at_unix": self.decided_at_unix,
                "figures": dict(self.report) or None}


def _rfc3339(unix: float) -> str:
    return datetime.fromtimestamp(unix, timezone.utc).isoformat().replace("+00:00", "Z")


def live_jobs(jobs: list[dict[str, Any]], now: float) -> list[dict[str, Any]]:
    """The jobs (``/v1/events``' ``jobs``) heard within JOB_SILENT_SECONDS, neither stopped
    nor finished."""
    return [job for job in jobs if job.get("state") not in ("stopped", "finished")
            and job.get("last_event_at_unix") is not None
            and now - job["last_event_at_unix"] <= JOB_SILENT_SECONDS]


def default_lead(jobs: list[dict[str, Any]]) -> Optional[float]:
    """Just over the largest budget of the live jobs: the save starts a few seconds after
    the drill does. None when no job has said its budget yet."""
    budgets = [job["budget_seconds"] for job in jobs if job.get("budget_seconds") is not None]
    if not budgets:
        return None
    budget = max(budgets)
    return math.ceil(budget + max(5.0, 0.1 * budget))


def lead_of(report: DrillReport) -> Optional[float]:
    """How long before the drill deadline the checkpoint was durable, by the report's own
    figures: its ``lead_seconds`` and, when it has them, ``remaining_seconds`` (at the
    save) less ``durable_seconds`` (from the save), the smaller of the two. None: unknown."""
    leads = [report.lead_seconds] if report.lead_seconds is not None else []
    if report.remaining_seconds is not None and report.durable_seconds is not None:
        leads.append(report.remaining_seconds - report.durable_seconds)
    return min(leads) if leads else None


def verdict_of(report: DrillReport, reason: Optional[str]) -> tuple[str, str]:
    """(result, reason) for a guard's report: PASS only for a checkpoint durable by the
    drill deadline, by every figure the report gives (a late one is a FAIL whatever the
    guard called it)."""
    lead = lead_of(report)
    if report.outcome == "durable" and lead is not None and lead >= 0:
        return "pass", f"durable {lead:.1f} s before the drill deadline"
    if report.outcome == "durable":
        if lead is None:
            return "fail", "durable, but the report says not when: no lead to hold it against"
        return "fail", f"durable {-lead:.1f} s after the drill deadline"
    why = {"not-durable": "the checkpoint was not durable by the drill deadline",
           "too-late": "the lead could not hold a save and its upload: no save started",
           "no-save": "no save was made for the drill deadline"}[report.outcome]
    return "fail", why if reason is None else f"{why} ({reason})"


class DrillBoard:
    """The current drill and the last ones. Thread-safe (the API's event loop, scrapes)."""

    def __init__(self, *, grace_seconds: float = DEFAULT_GRACE_SECONDS,
                 history: int = HISTORY) -> None:
        self.grace_seconds = grace_seconds
        self._lock = threading.Lock()
        self._drills: deque[Drill] = deque(maxlen=history)  # oldest first
        self._counter = 0
        self._counts = dict.fromkeys(RESULTS, 0)

    def start(self, lead_seconds: Optional[float], *, real_deadline: Optional[float],
              jobs: list[dict[str, Any]], now: float) -> Drill:
        """A new drill ``lead_seconds`` from now (None: :func:`default_lead`), or
        :class:`DrillRefused` naming the problem."""
        live = live_jobs(jobs, now)
        if not live:
            raise DrillRefused(409, "no-job", "no job answers this daemon: none sent an "
                               f"event in the last {JOB_SILENT_SECONDS:.0f} s, or each said "
                               "it stopped or finished")
        if lead_seconds is None:
            lead_seconds = default_lead(live)
            if lead_seconds is None:
                raise DrillRefused(409, "no-budget", "the job has not said its save budget "
                                   "yet: give in_seconds")
        if isinstance(lead_seconds, bool) or not isinstance(lead_seconds, (int, float)) or not (
            MIN_LEAD_SECONDS <= lead_seconds <= MAX_LEAD_SECONDS
        ):
            raise DrillRefused(422, "lead", f"in_seconds must be a number from "
                               f"{MIN_LEAD_SECONDS:g} to {MAX_LEAD_SECONDS:g}, got "
                               f"{lead_seconds!r:.40}")
        expires = now + float(lead_seconds)
        with self._lock:
            self._tick(real_deadline, now)
            current = self._drills[-1] if self._drills else None
            if current is not None and current.result is None:
                raise DrillRefused(409, "drill-running", f"{current.id} runs (deadline "
                                   f"{_rfc3339(current.expires_at_unix)}, verdict by "
                                   f"{current.expires_at_unix + current.grace_seconds - now:.0f}"
                                   " s from now): wait for it (GET /v1/drill)")
            if real_deadline is not None and real_deadline <= expires + self.grace_seconds:
                raise DrillRefused(409, "real-deadline", "a real deadline at "
                                   f"{_rfc3339(real_deadline)} falls inside the drill's window "
                                   f"(until {_rfc3339(expires + self.grace_seconds)}): no drill "
                                   "while the machine is about to go")
            self._counter += 1
            drill = Drill(id=f"drill-{self._counter}", started_at_unix=now,
                          expires_at_unix=expires, lead_seconds=float(lead_seconds),
                          grace_seconds=self.grace_seconds)
            self._drills.append(drill)
            return drill

    def served(self, real_deadline: Optional[float], now: float) -> Optional[dict[str, Any]]:
        """The ``drill`` object of ``/v1/expiry`` (None: no drill under way). Cheap when
        none is: the training loop may ask every step."""
        if not self._drills:
            return None
        with self._lock:
            self._tick(real_deadline, now)
            return self._drills[-1].served(now)

    def report(self, report: DrillReport, *, job: str, rank: Optional[int],
               step: Optional[int], reason: Optional[str], now: float) -> None:
        """A guard's report: decides its drill (a later failing report of another rank
        turns a PASS into a FAIL; a report after the verdict changes nothing else)."""
        with self._lock:
            drill = next((d for d in self._drills if d.id == report.id), None)
            if drill is None:
                return  # a drill of an earlier daemon process, or not ours
            result, why = verdict_of(report, reason)
            if drill.result is None or (drill.result == "pass" and result == "fail"):
                if drill.result is not None:
                    self._counts[drill.result] -= 1
                drill.result, drill.reason, drill.decided_at_unix = result, why, now
                self._counts[result] += 1
                extra = {"job": job, "rank": rank, "step": step}
                drill.report = {**report.model_dump(exclude_none=True),
                                **{k: v for k, v in extra.items() if v is not None}}

    def body(self, real_deadline: Optional[float], now: float) -> dict[str, Any]:
        """``GET /v1/drill``: the current (or last) drill, the last ones newest first, the
        counts by result."""
        with self._lock:
            self._tick(real_deadline, now)
            drills = [d.to_json(now) for d in reversed(self._drills)]
            counts = dict(self._counts)
        current = drills[0] if drills and drills[0]["state"] != "decided" else None
        return {"drill": current, "drills": drills, "counts": counts,
                "server_time_unix": now}

    def metrics(self, now: float) -> tuple[dict[str, int], Optional[Drill], bool]:
        """(counts by result, the last decided drill, whether one runs) for /metrics."""
        with self._lock:
            decided = [d for d in self._drills if d.result is not None]
            running = bool(self._drills) and self._drills[-1].result is None
            return dict(self._counts), decided[-1] if decided else None, running

    def _tick(self, real_deadline: Optional[float], now: float) -> None:
        """A real deadline before the drill's calls it off; the grace over with no report
        is "no answer". Under the lock."""
        if not self._drills:
            return
        drill = self._drills[-1]
        if drill.result is not None:
            return
        if real_deadline is not None and real_deadline < drill.expires_at_unix:
            self._decide(drill, "called-off", f"a real deadline at {_rfc3339(real_deadline)} "
                         "came before the drill's: it wins", now)
        elif now >= drill.expires_at_unix + drill.grace_seconds:
            self._decide(drill, "no-answer", "no answer: no job reported on the drill by its "
                         f"deadline + {drill.grace_seconds:g} s (the job died, or its guard "
                         "does not know drills)", now)

    def _decide(self, drill: Drill, result: str, reason: str, now: float) -> None:
        drill.result, drill.reason, drill.decided_at_unix = result, reason, now
        self._counts[result] += 1
