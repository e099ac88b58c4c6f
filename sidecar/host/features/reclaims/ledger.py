"""The cost of each release the daemon saw its job through: ``GET /v1/reclaims``.

From the job events (``features.events``): when a job stops because the release came
(a ``stop`` event with ``released``), ``check()`` closes its account with the pure rule
(``sidecar.train.reclaim_cost``): the state the next machine resumes from is the start of
the save of the newest durable checkpoint (the newest save without an uploader), idle
the wait after the final save, redone the training after that state. The accounts are the
``reclaims`` section of the state file (``sidecar.host.statefile``), so a restart keeps
them; exported in ``/metrics`` (counters and a histogram of lost seconds) and drawn on the
status page (issue 24, item 3).

The time to resume (issue 40, item 3): an account a restore posts on the next machine stays
open until the job's first step there (its first ``step-estimate`` or save event after
the restore); then it closes with the time from the release to that step, split into
waiting for a machine, the restore (the follower's copy when it brought the checkpoint
the restore found in place: :meth:`ReclaimLedger.note_restore`) and the job's start-up.
Served in each account, as a histogram beside the lost seconds, and in the ratio.

What is posted is hostile input (issue 35, item 7): any local process can post events or
an account. So the mean time between reclaims comes only from the releases the daemon saw
itself (``releases_seen``), never from an account; accounts are attributed
(``posted_by``), counted once per job and release, refused when a figure exceeds what
this daemon could have seen (its uptime plus a day: 422 naming the field), admitted
:data:`ACCOUNTS_BURST` at once then one a minute per sender as ``posted_by`` names it (429:
the job events, all jobs together, since any process names a job; each peer posting a
restore's; :data:`SENDERS_KEPT` senders remembered), so a flooder spends its own allowance,
not an honest restore's from another peer; logged at most one line a minute, the others
counted in that line.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from sidecar.host.features.reclaims.releases_seen import NEAR_SECONDS, ReleasesSeen
from sidecar.host.token_buckets import KeyedBuckets
from sidecar.train.protection import short_duration
from sidecar.train.reclaim_cost import ReleaseCost, effective_ratio, release_cost, with_resume

__all__ = ["ACCOUNTS_BURST", "LOST_BUCKETS", "SENDERS_KEPT", "AccountRefused", "ReclaimLedger",
           "account_from_events"]

log = logging.getLogger("sidecar.host.reclaims")

KEPT = 50  # accounts kept (the counters count every one)
CLOSED_KEPT = 1000  # (job, release) keys remembered against a second count
# Accounts admitted: this many at once, then one a minute (a node's jobs released together,
# and a restore each, fit in the burst; releases come hours apart).
ACCOUNTS_BURST = 10
ACCOUNTS_PER_SECOND = 1 / 60
# Senders whose allowance is remembered (least recently heard forgotten first): the job
# events and the peers posting restores (a node's pods under hostNetwork), many times over.
SENDERS_KEPT = 64
LOG_EVERY_SECONDS = 60.0  # one line about accounts a minute at most, the rest counted
# What no account can exceed: the daemon's uptime plus this (a restore accounts the previous
# machine's release, before this daemon started).
SLACK_SECONDS = 86400.0
STATE_VERSION = 1
# Lost GPU seconds per release: a good save loses a step or two, a missed one hours.
LOST_BUCKETS = (10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0, 7200.0, 21600.0)
# Seconds from a release to the first step on the next machine: a waiting checkpoint and a
# warm image resume in well under a minute, a cold pull and a slow restore in many.
RESUME_BUCKETS = (10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0, 3600.0)
# The events that say the job trains: its first step (a step estimate) or a save.
STEP_KINDS = frozenset(("step-estimate", "save-started", "save-finished"))
BROUGHT_KEPT = 16  # the follower's copies remembered (one per checkpoint it brought)


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


class AccountRefused(ValueError):
    """An account not kept: ``status`` 422 (a figure beyond what could be) or 429 (over the
    rate); the message names the field or the limit."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class _Account:
    cost: ReleaseCost
    posted_by: str  # "job events" (closed by the daemon from them) or "restore from PEER"

    def to_json(self) -> dict[str, Any]:
        return {**self.cost.to_json(), "posted_by": self.posted_by}


Deadline = Callable[[float], Optional[tuple[str, float]]]


class ReclaimLedger:
    """The accounts of the releases this daemon saw, newest last; a state file section.

    ``deadline(now)``: the deadline the daemon's own sources serve now, as (source, Unix
    time), or None; the releases seen come from it alone."""

    name = "reclaims"
    what = "the reclaim costs"
    required = False

    def __init__(self, events: Optional[_Events] = None, *, uploads: bool = False,
                 on_change: Optional[Callable[[], None]] = None,
                 deadline: Optional[Deadline] = None,
                 clock: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self._events = events
        self._uploads = uploads
        self._on_change = on_change
        self._deadline = deadline
        self._clock, self._monotonic = clock, monotonic
        self._started = clock()
        self._lock = threading.Lock()
        self._accounts: deque[_Account] = deque(maxlen=KEPT)
        self._totals = {"count": 0, "lost": 0.0, "idle": 0.0, "redone": 0.0, "saves": 0}
        self._observed: list[float] = []  # every lost figure, for the histogram (bounded)
        self._closed: OrderedDict[tuple[Optional[str], float], None] = OrderedDict()
        self._seen = ReleasesSeen(self._started)
        self._admit: KeyedBuckets[str] = KeyedBuckets(ACCOUNTS_PER_SECOND, ACCOUNTS_BURST,
                                                      SENDERS_KEPT, monotonic)
        self._refused = {"implausible": 0, "rate": 0}
        self._logged_at: Optional[float] = None
        self._unlogged = 0
        self._brought: OrderedDict[str, tuple[float, float]] = OrderedDict()
        self._resumes: list[float] = []  # every time to resume, for the histogram (bounded)

    def note_restore(self, name: str, started_unix: float, finished_unix: float) -> None:
        """The follower put ``name`` in place between these instants (issue 40)."""
        with self._lock:
            self._brought[name] = (started_unix, finished_unix)
            while len(self._brought) > BROUGHT_KEPT:
                self._brought.popitem(last=False)

    def brought(self, name: object) -> Optional[tuple[float, float]]:
        """When the follower brought ``name`` (its start and end), or None."""
        with self._lock:
            return self._brought.get(name) if isinstance(name, str) else None

    def record(self, cost: ReleaseCost, posted_by: str = "job events") -> bool:
        """Keep one account (once per job and release); True when it was new, False when
        it was kept already; :class:`AccountRefused` when it is not kept."""
        key = _key(cost)
        bound = max(0.0, self._clock() - self._started) + SLACK_SECONDS
        with self._lock:
            if key in self._closed:
                return False
            for name in ("lost_seconds", "idle_seconds", "redone_seconds"):
                value = getattr(cost, name)
                if value > bound:
                    self._refused["implausible"] += 1
                    self._log_or_count(logging.WARNING, "refused an account from %s: %s %.0f s "
                                       "is more than this daemon ran plus a day", posted_by,
                                       name, value)
                    raise AccountRefused(
                        f"{name}: {value:.0f} s (released_unix - state_unix for lost_seconds) "
                        f"is more than this daemon has run plus a day ({bound:.0f} s)", 422)
            if not self._admit.bucket(posted_by).take():
                self._refused["rate"] += 1
                self._log_or_count(logging.WARNING, "refused an account from %s: over %d "
                                   "at once, then one a minute", posted_by, ACCOUNTS_BURST)
                raise AccountRefused(f"accounts: more than {ACCOUNTS_BURST} at once, then one "
                                     "a minute from one sender; try later", 429)
            self._remember(key)
            self._accounts.append(_Account(cost, posted_by))
            self._count(cost)
            # A warning when it cost more than ten minutes: a save that came too late.
            self._log_or_count(
                logging.WARNING if cost.lost_seconds > 600 else logging.INFO,
                "%s: the release cost %s of GPU time %s (%s redone, %s idle, %d "
                "saves; posted by %s)", cost.job, short_duration(cost.lost_seconds),
                _from_step(cost.resumed_step), short_duration(cost.redone_seconds),
                short_duration(cost.idle_seconds), cost.saves, posted_by)
        if self._on_change is not None:
            self._on_change()
        return True

    def _remember(self, key: tuple[Optional[str], float]) -> None:
        self._closed[key] = None
        while len(self._closed) > CLOSED_KEPT:
            self._closed.popitem(last=False)

    def _log_or_count(self, level: int, message: str, *args: object) -> None:
        """One line a minute at most: the others are counted and said with the next."""
        now = self._monotonic()
        if self._logged_at is not None and now - self._logged_at < LOG_EVERY_SECONDS:
            self._unlogged += 1
            return
        more, self._unlogged, self._logged_at = self._unlogged, 0, now
        suffix = f" (and {more} more about accounts since the last line: GET /v1/reclaims)"
        log.log(level, message + (suffix if more else ""), *args)

    def _count(self, cost: ReleaseCost) -> None:
        totals = self._totals
        totals["count"] += 1
        totals["lost"] += cost.lost_seconds
        totals["idle"] += cost.idle_seconds
        totals["redone"] += cost.redone_seconds
        totals["saves"] += cost.saves
        self._observed = [*self._observed, cost.lost_seconds][-10_000:]
        if cost.resume_seconds is not None:  # closed already (a restart's own accounts)
            totals["resume"] = totals.get("resume", 0.0) + cost.resume_seconds
            self._resumes = [*self._resumes, cost.resume_seconds][-10_000:]

    def _close_resumes(self, history: list[dict[str, Any]]) -> None:
        """Close each open account at the first step after its restore."""
        with self._lock:
            open_ = [a for a in self._accounts if a.cost.resumed_unix is None
                     and a.cost.restore_finished_unix is not None]
        closed = []
        for account in open_:
            after = account.cost.restore_finished_unix or 0.0
            steps = [float(e["at_unix"]) for e in history
                     if e["kind"] in STEP_KINDS and float(e["at_unix"]) >= after]
            if not steps:
                continue
            cost = with_resume(account.cost, restore_started_unix=account.cost.
                               restore_started_unix or after, restore_finished_unix=after,
                               resumed_unix=min(steps))
            closed.append((account, _Account(cost, account.posted_by)))
        if not closed:
            return
        with self._lock:
            for old, new in closed:
                self._accounts = deque((new if a is old else a for a in self._accounts),
                                       maxlen=KEPT)
                self._totals["resume"] = self._totals.get("resume", 0.0) + (
                    new.cost.resume_seconds or 0.0)
                self._resumes = [*self._resumes, new.cost.resume_seconds or 0.0][-10_000:]
        for _, new in closed:
            split = new.cost.resume_split() or {}
            log.info("training again %.0f s after the release (waiting for a machine %.0f s, "
                     "restore %.1f s, start-up %.1f s)", new.cost.resume_seconds or 0.0,
                     split.get("waiting", 0.0), split.get("restore", 0.0),
                     split.get("startup", 0.0))
        if self._on_change is not None:
            self._on_change()

    def check(self) -> None:
        """Note the release of the deadline the daemon serves when it comes, and close the
        account of every job whose events end with the release."""
        now = self._clock()
        served = None if self._deadline is None else self._deadline(now)
        if served is not None and served[1] <= now:
            self._see(served)
        if self._events is None:
            return
        history = list(reversed(self._events.body(limit=500).get("events", [])))
        self._close_resumes(history)
        for job in {e["job"] for e in history if e["kind"] == "stop" and e.get("released")}:
            cost = account_from_events([e for e in history if e["job"] == job],
                                       uploads=self._uploads)
            if cost is None:
                continue
            try:
                recorded = self.record(cost)
            except AccountRefused as exc:
                if exc.status == 422:  # never asked again; over the rate: asked later
                    with self._lock:
                        self._remember(_key(cost))
                continue
            if recorded and served is not None and served[1] - now <= NEAR_SECONDS:
                self._see(served)  # a job stopped for the release the daemon serves

    def _see(self, served: tuple[str, float]) -> None:
        with self._lock:
            release = self._seen.see(*served)
        if release is None:
            return
        log.info("release seen: %s's deadline %.0f, %s after the one before (or the start "
                 "of watching)", release.source, release.released_unix,
                 short_duration(release.life_seconds))
        if self._on_change is not None:
            self._on_change()

    def remembered(self) -> int:
        """How many (job, release) keys are remembered against a second count."""
        with self._lock:
            return len(self._closed)

    def body(self) -> dict[str, Any]:
        """The ``GET /v1/reclaims`` body: the accounts newest first, the totals, and the
        releases the daemon saw itself (``releases_seen``: the mean time between reclaims
        is theirs, never the accounts')."""
        with self._lock:
            accounts = list(self._accounts)
            totals = dict(self._totals)
            seen = self._seen.to_json()
            refused = dict(self._refused)
        return {"reclaims": [a.to_json() for a in reversed(accounts)],
                "count": totals["count"], "lost_seconds_total": totals["lost"],
                "idle_seconds_total": totals["idle"],
                "redone_seconds_total": totals["redone"],
                "resume_seconds_total": totals.get("resume", 0.0),
                "effective_ratio": effective_ratio([a.cost for a in accounts]),
                "releases_seen": seen, "refused": refused}

    # ------------------------------------------------------------------ state file

    def dump(self) -> dict[str, Any]:
        with self._lock:
            return {"version": STATE_VERSION, "costs": [a.to_json() for a in self._accounts],
                    "totals": dict(self._totals), "seen": self._seen.dump()}

    def load(self, section: Any) -> None:
        """All or nothing; ValueError naming the first bad field."""
        if not isinstance(section, dict) or section.get("version") != STATE_VERSION:
            raise ValueError("not a reclaims section of version 1")
        raw, totals = section.get("costs", []), section.get("totals", {})
        if not isinstance(raw, list) or not isinstance(totals, dict):
            raise ValueError("costs: not a list, or totals: not an object")
        accounts = []
        for index, item in enumerate(raw[-KEPT:]):
            if not isinstance(item, dict):
                raise ValueError(f"costs[{index}]: not an object")
            try:
                cost = ReleaseCost.from_json(item)
            except (ValueError, TypeError) as exc:
                raise ValueError(f"costs[{index}].{exc}") from None
            posted_by = item.get("posted_by")
            if not isinstance(posted_by, str):
                posted_by = "job events" if cost.closed_by == "daemon" else "restore"
            accounts.append(_Account(cost, posted_by[:100]))
        kept = {}
        for name in ("count", "lost", "idle", "redone", "saves", "resume"):
            value = totals.get(name, 0)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"totals.{name}: not a non-negative number")
            kept[name] = value
        seen = ReleasesSeen(self._started)
        seen.load(section.get("seen"))
        with self._lock:
            self._accounts.extend(accounts)
            for account in accounts:
                self._remember(_key(account.cost))
            self._totals = kept
            self._observed = [a.cost.lost_seconds for a in accounts]
            self._resumes = [a.cost.resume_seconds for a in accounts
                             if a.cost.resume_seconds is not None]
            self._seen = seen

    # ------------------------------------------------------------------ metrics

    def collect(self) -> list[Metric]:
        with self._lock:
            totals = dict(self._totals)
            observed = list(self._observed)
            resumes = list(self._resumes)
            resume_total = self._totals.get("resume", 0.0)
            ratio = effective_ratio([a.cost for a in self._accounts])
            refused = dict(self._refused)
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
        refused_metric = CounterMetricFamily(
            "esi_sidecar_reclaim_accounts_refused", "Accounts not kept, by reason: "
            "implausible (a figure beyond the daemon's uptime plus a day) or rate (over "
            f"{ACCOUNTS_BURST} at once, then one a minute)", labels=["reason"])
        for reason, count in refused.items():
            refused_metric.add_metric([reason], count)
        resume_buckets = [(f"{bound:g}", sum(1 for value in resumes if value <= bound))
                          for bound in RESUME_BUCKETS] + [("+Inf", len(resumes))]
        resume = HistogramMetricFamily(
            "esi_sidecar_release_resume_seconds", "Seconds from each release to the job's "
            "first step on the next machine (waiting for a machine, restore, start-up; the "
            f"last {KEPT} kept across restarts)", buckets=resume_buckets,
            sum_value=sum(resumes))
        resume_counter = CounterMetricFamily(
            "esi_sidecar_reclaim_resume_seconds", "Seconds from releases to the first step "
            "on the next machine, every account closed")
        resume_counter.add_metric([], resume_total)
        return [*counters, resume_counter, histogram, resume, effective, refused_metric]


def _from_step(step: Optional[int]) -> str:
    """Where the job resumed, in words: a checkpoint may name no step."""
    return "from a checkpoint that names no step" if step is None else f"from step {step}"


def _key(cost: ReleaseCost) -> tuple[Optional[str], float]:
    return (cost.job, round(cost.released_unix, 3))
