"""The cost of each release the daemon saw its job through: ``GET /v1/reclaims``.

From the job events (``sidecar.host.events``): when a job stops because the release came
(a ``stop`` event with ``released``), ``check()`` closes its account with the pure rule
(``sidecar.train.reclaim_cost``): the state the next machine resumes from is the start of
the save of the newest durable checkpoint (the newest save without an uploader), idle
the wait after the final save, redone the training after that state. The accounts are the
``reclaims`` section of the state file (``sidecar.host.statefile``), so a restart keeps
them; exported in ``/metrics`` (counters and a histogram of lost seconds) and drawn on the
status page (issue 24, item 3).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Any, Callable, Optional, Protocol

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from sidecar.train.protection import short_duration
from sidecar.train.reclaim_cost import ReleaseCost, effective_ratio, release_cost

__all__ = ["LOST_BUCKETS", "ReclaimLedger", "account_from_events"]

log = logging.getLogger("sidecar.host.reclaims")

KEPT = 50  # accounts kept (the counters count every one)
STATE_VERSION = 1
# Lost GPU seconds per release: a good save loses a step or two, a missed one hours.
LOST_BUCKETS = (10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0, 7200.0, 21600.0)


class _Events(Protocol):
    def body(self, limit: int = 100, now: Optional[float] = None) -> dict[str, Any]: ...


def account_from_events(events: list[dict[str, Any]], *, uploads: bool) -> Optional[ReleaseCost]:
    """The account of the newest release in ``events`` (one job's, oldest first), None
    when none of them is a ``stop`` for the release."""
    stops = [i for i, e in enumerate(events) if e["kind"] == "stop" and e.get("released")]
    if not stops:
        return None
    stop = events[stops[-1]]
    earlier = [e for e in events[: stops[-1]]
               if len(stops) < 2 or e["at_unix"] > events[stops[-2]]["at_unix"]]
    released = float(stop["at_unix"])
    started = {e.get("step"): float(e["at_unix"]) for e in earlier if e["kind"] == "save-started"}
    saves = [e for e in earlier if e["kind"] == "save-finished"]
    kept = [e for e in earlier if e["kind"] == "durable"] if uploads else saves
    state, step = (earlier[0]["at_unix"] if earlier else released), None
    if kept:
        step = kept[-1].get("step")
        finished = next((float(e["at_unix"]) for e in reversed(saves) if e.get("step") == step),
                        float(kept[-1]["at_unix"]))
        state = started.get(step, finished)
    waits = [float(e["at_unix"]) for e in earlier if e["kind"] == "waiting"]
    stopped = waits[-1] if waits else released
    # Training: the time between the state and the stop that no save took.
    busy = sorted((started.get(e.get("step"), float(e["at_unix"]) - float(e["seconds"])),
                   float(e["at_unix"])) for e in saves)
    trained, cursor = [], float(state)
    for begin, end in busy:
        if end <= cursor:
            continue
        trained.append((cursor, max(cursor, min(begin, stopped))))
        cursor = end
    trained.append((cursor, max(cursor, stopped)))
    return release_cost(
        released_unix=released, state_unix=float(state), resumed_step=step, trained=trained,
        idle_seconds=max(0.0, released - stopped), saves=len(saves),
        started_unix=float(earlier[0]["at_unix"]) if earlier else None, job=stop["job"])


class ReclaimLedger:
    """The accounts of the releases this daemon saw, newest last; a state file section."""

    name = "reclaims"
    what = "the reclaim costs"
    required = False

    def __init__(self, events: Optional[_Events] = None, *, uploads: bool = False,
                 on_change: Optional[Callable[[], None]] = None) -> None:
        self._events = events
        self._uploads = uploads
        self._on_change = on_change
        self._lock = threading.Lock()
        self._costs: deque[ReleaseCost] = deque(maxlen=KEPT)
        self._totals = {"count": 0, "lost": 0.0, "idle": 0.0, "redone": 0.0, "saves": 0}
        self._observed: list[float] = []  # every lost figure, for the histogram (bounded)
        self._closed: set[tuple[Optional[str], float]] = set()

    def record(self, cost: ReleaseCost) -> bool:
        """Keep one account (once per job and release); True when it was new."""
        key = (cost.job, round(cost.released_unix, 3))
        with self._lock:
            if key in self._closed:
                return False
            self._closed.add(key)
            self._costs.append(cost)
            self._count(cost)
        # A warning when it cost more than ten minutes: a save that came too late.
        log.log(logging.WARNING if cost.lost_seconds > 600 else logging.INFO,
                "%s: the release cost %s of GPU time from step %s (%s redone, %s idle, %d "
                "saves)", cost.job, short_duration(cost.lost_seconds), cost.resumed_step,
                short_duration(cost.redone_seconds), short_duration(cost.idle_seconds),
                cost.saves)
        if self._on_change is not None:
            self._on_change()
        return True

    def _count(self, cost: ReleaseCost) -> None:
        totals = self._totals
        totals["count"] += 1
        totals["lost"] += cost.lost_seconds
        totals["idle"] += cost.idle_seconds
        totals["redone"] += cost.redone_seconds
        totals["saves"] += cost.saves
        self._observed = [*self._observed, cost.lost_seconds][-10_000:]

    def check(self) -> None:
        """Close the account of every job whose events end with the release."""
        if self._events is None:
            return
        history = list(reversed(self._events.body(limit=500).get("events", [])))
        for job in {e["job"] for e in history if e["kind"] == "stop" and e.get("released")}:
            cost = account_from_events([e for e in history if e["job"] == job],
                                       uploads=self._uploads)
            if cost is not None:
                self.record(cost)

    def body(self) -> dict[str, Any]:
        """The ``GET /v1/reclaims`` body: the accounts newest first, and the totals."""
        with self._lock:
            costs = list(self._costs)
            totals = dict(self._totals)
        return {"reclaims": [c.to_json() for c in reversed(costs)],
                "count": totals["count"], "lost_seconds_total": totals["lost"],
                "idle_seconds_total": totals["idle"],
                "redone_seconds_total": totals["redone"],
                "effective_ratio": effective_ratio(costs)}

    # ------------------------------------------------------------------ state file

    def dump(self) -> dict[str, Any]:
        with self._lock:
            return {"version": STATE_VERSION, "costs": [c.to_json() for c in self._costs],
                    "totals": dict(self._totals)}

    def load(self, section: Any) -> None:
        """All or nothing; ValueError naming the first bad field."""
        if not isinstance(section, dict) or section.get("version") != STATE_VERSION:
            raise ValueError("not a reclaims section of version 1")
        raw, totals = section.get("costs", []), section.get("totals", {})
        if not isinstance(raw, list) or not isinstance(totals, dict):
            raise ValueError("costs: not a list, or totals: not an object")
        costs = []
        for index, item in enumerate(raw[-KEPT:]):
            if not isinstance(item, dict):
                raise ValueError(f"costs[{index}]: not an object")
            try:
                costs.append(ReleaseCost.from_json(item))
            except (ValueError, TypeError) as exc:
                raise ValueError(f"costs[{index}].{exc}") from None
        kept = {}
        for name in ("count", "lost", "idle", "redone", "saves"):
            value = totals.get(name, 0)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"totals.{name}: not a non-negative number")
            kept[name] = value
        with self._lock:
            self._costs.extend(costs)
            self._closed.update((c.job, round(c.released_unix, 3)) for c in costs)
            self._totals = kept
            self._observed = [c.lost_seconds for c in costs]

    # ------------------------------------------------------------------ metrics

    def collect(self) -> list[Metric]:
        with self._lock:
            totals = dict(self._totals)
            observed = list(self._observed)
            ratio = effective_ratio(self._costs)
        counters = []
        for name, key, text in (
            ("reclaims", "count", "Releases and reclaims whose cost the daemon accounted"),
            ("reclaim_lost_seconds", "lost", "GPU seconds lost to releases: from the state "
             "the next machine resumes from to the release"),
            ("reclaim_idle_seconds", "idle", "Of the lost GPU seconds: waiting for the "
             "release after the final save"),
            ("reclaim_redone_seconds", "redone", "Of the lost GPU seconds: training after "
             "the newest durable checkpoint, to do again"),
            ("reclaim_saves", "saves", "Saves the job made on the machines it left"),
        ):
            counter = CounterMetricFamily(f"esi_sidecar_{name}", text)
            counter.add_metric([], totals[key])
            counters.append(counter)
        buckets, count = [], 0
        for bound in LOST_BUCKETS:
            count = sum(1 for value in observed if value <= bound)
            buckets.append((f"{bound:g}", count))
        buckets.append(("+Inf", len(observed)))
        histogram = HistogramMetricFamily(
            "esi_sidecar_release_lost_seconds", "GPU seconds each release cost (the last "
            f"{KEPT} kept across restarts)", buckets=buckets, sum_value=sum(observed))
        effective = GaugeMetricFamily(
            "esi_sidecar_effective_training_ratio", "Wall time on state that survived over "
            "wall time, across the releases accounted (absent before one)")
        if ratio is not None:
            effective.add_metric([], ratio)
        return [*counters, histogram, effective]
