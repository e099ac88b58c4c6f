"""What the training jobs on this node say happened: ``POST /v1/events``, ``GET /v1/events``.

The guard (``sidecar.train.guard``) posts small events (step estimates, saves started and
finished, durable checkpoints, the wait for the release, the stop); this module validates
them, keeps a bounded history (in memory, and as the ``events`` section of the state file,
``sidecar.host.statefile``, so a restart keeps it), serves it newest first with a summary,
and exports the summary to ``/metrics``. Events are the job's word, shown, never acted on:
nothing here reaches the store, so no event can move the deadline (issue 14, item 1).

Bounded everywhere: a request body of at most 64 KiB and 100 events, strings of at most a
few hundred characters (longer is a 422, not a truncation), token buckets per job and per
peer beyond which events are dropped and counted, a history of 500 events, the last state
of at most 64 jobs and the last step of at most 64 (job, rank) pairs. The events that carry
a save or durability are never rate-limited with the rest (a bucket of their own per job,
far above what a guard sends), and a full history gives up an event of the job that holds
the most, so a flood by one job pushes out its own events, not another's (issue 22).
"""

from __future__ import annotations

import logging
import reprlib
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping
from typing import Annotated, Any, Callable, Literal, Optional

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from sidecar.host.connections import HEADER_TIMEOUT_SECONDS
from sidecar.host.features.events.drill_report import DrillReport
from sidecar.host.token_buckets import KeyedBuckets

__all__ = ["EVENTS_STATE_KEY", "KINDS", "EventHistory", "JobEvent", "Listener", "problem_line"]

log = logging.getLogger("sidecar.host.events")

KINDS = ("step-estimate", "save-started", "save-finished", "durable", "not-durable",
         "too-late", "waiting", "resumed", "stop", "drill", "finished")
HISTORY_LENGTH = 500
MAX_EVENTS_PER_REQUEST = 100
MAX_BODY_BYTES = 64 * 1024
# A body over MAX_BODY_BYTES is read to its end, up to this, and thrown away before the
# 413, so that a client still sending can read the answer (closing on unread bytes resets
# the connection); a longer one is not read: the connection closes (issue 22).
MAX_DISCARDED_BYTES = 16 * 1024 * 1024
DISCARD_SECONDS = HEADER_TIMEOUT_SECONDS  # the time the rest of such a body may take
MAX_LIMIT = HISTORY_LENGTH
# Per job and per peer (the client's address): one process flooding must not spend the
# others' allowance. A guard sends a few events per save and one estimate every 30 s per
# rank, far below this. On loopback every local process is one peer: its bucket is wider.
RATE_PER_SECOND = 20.0
BURST_EVENTS = 200.0
PEER_FACTOR = 4.0  # a peer's bucket, in jobs' buckets
# The events that carry a save or durability skip those buckets: a bucket of their own per
# job, a few saves a minute at most from a guard.
SAVE_RATE_PER_SECOND = 1.0
SAVE_BURST_EVENTS = 50.0
SAVE_KINDS = ("save-finished", "durable", "not-durable", "drill")
MAX_TRACKED_JOBS = 64  # jobs whose last state is kept; (job, rank) pairs whose last step
MAX_TRACKED_PEERS = 256  # peers, and jobs, with a rate bucket
EVENTS_STATE_KEY = "events"
STATE_VERSION = 1
# A time on the daemon's clock: between 2000 and the year 5138, and an event's own time
# within a day before the daemon's clock and five minutes after (the same host's clock).
_EARLIEST_UNIX = 946684800.0
_LATEST_UNIX = 1e11
_PAST_SKEW_SECONDS = 86400.0
_FUTURE_SKEW_SECONDS = 300.0
_MAX_SECONDS = 1e7  # a duration: about 116 days, as the API's queries
_MAX_LEAD_SECONDS = 1e10  # a time left until a deadline: a far static one is years away

Seconds = Annotated[float, Field(ge=0, le=_MAX_SECONDS, allow_inf_nan=False)]
SignedSeconds = Annotated[float, Field(ge=-_MAX_LEAD_SECONDS, le=_MAX_LEAD_SECONDS,
                                       allow_inf_nan=False)]
Step = Annotated[int, Field(ge=0, le=2**53)]
UnixTime = Annotated[float, Field(ge=_EARLIEST_UNIX, le=_LATEST_UNIX, allow_inf_nan=False)]
# Printable, one line: what a log line or a dashboard shows as is.
Text = Annotated[str, Field(min_length=1, max_length=300, pattern=r"^[^\x00-\x1f\x7f]*$")]
JobId = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[!-~]+$")]
# "drill": the save made for a fire drill's deadline (docs/drill.md), not a release's.
SaveKind = Literal["final", "top-up", "routine", "fallback", "drill"]
# "finished": the job said it ended (its guard's ``finished`` event): no longer running.
JobState = Literal["training", "saving", "waiting", "stopped", "finished"]


class JobEvent(BaseModel):
    """One event, as a job posts it. Unknown fields, wrong types (``"12"`` for a step,
    ``1.5`` for a step, ``1`` for a flag) and out-of-range values are refused."""

    model_config = ConfigDict(extra="forbid", strict=True)

    kind: Literal[KINDS]  # type: ignore[valid-type]
    job: JobId  # who: the guard sends hostname:pid unless told otherwise
    rank: Optional[Annotated[int, Field(ge=0, le=1_000_000)]] = None
    at_unix: Optional[UnixTime] = None  # when it happened (default: when it arrived)
    step: Optional[Step] = None  # the training step a checkpoint holds
    # Which save: the final one, the top-up, a routine one, the fallback before the final.
    save: Optional[SaveKind] = None
    seconds: Optional[Seconds] = None  # save-finished: how long the save took
    asynchronous: Optional[bool] = None  # save-finished: its writing goes on after seconds
    lead_seconds: Optional[SignedSeconds] = None  # durable: how long before the release
    step_seconds: Optional[Seconds] = None  # the step estimate the rule used
    save_seconds: Optional[Seconds] = None  # the save estimate the rule used
    budget_seconds: Optional[Seconds] = None  # step + save (+ upload) + margin
    remaining_seconds: Optional[SignedSeconds] = None  # as the job saw it, at at_unix
    released: Optional[bool] = None  # stop, finished: because the release came
    reason: Optional[Text] = None
    drill: Optional[DrillReport] = None  # drill: the guard's figures (features.drills)

    @field_validator("at_unix")
    @classmethod
    def _near_now(cls, value: Optional[float], info: ValidationInfo) -> Optional[float]:
        now = (info.context or {}).get("now")
        if value is not None and now is not None and not (
            now - _PAST_SKEW_SECONDS <= value <= now + _FUTURE_SKEW_SECONDS
        ):
            raise ValueError(f"must be within a day before the daemon's clock ({now:.0f})")
        return value

    @model_validator(mode="after")
    def _needs(self) -> JobEvent:
        if self.kind == "save-finished" and self.seconds is None:
            raise ValueError("save-finished needs seconds (how long the save took)")
        return self


class StoredEvent(JobEvent):
    """An event as kept and served: when it arrived, and why it looks wrong, if it does."""

    received_at_unix: UnixTime
    flag: Optional[Text] = None


class Summary(BaseModel):
    """The newest of each thing, kept apart from the history so that a flood of one kind
    of event never pushes the last save out of it."""

    model_config = ConfigDict(extra="forbid", strict=True)

    job: Optional[JobId] = None
    rank: Optional[int] = None
    state: Optional[JobState] = None
    last_event_at_unix: Optional[UnixTime] = None
    last_save_step: Optional[Step] = None
    last_save: Optional[SaveKind] = None
    last_save_at_unix: Optional[UnixTime] = None
    last_save_seconds: Optional[Seconds] = None
    last_durable_step: Optional[Step] = None
    last_durable_at_unix: Optional[UnixTime] = None
    step_seconds: Optional[Seconds] = None
    save_seconds: Optional[Seconds] = None
    budget_seconds: Optional[Seconds] = None
    remaining_seconds: Optional[SignedSeconds] = None
    decision_at_unix: Optional[UnixTime] = None


_STORED = TypeAdapter(Annotated[list[StoredEvent], Field(max_length=HISTORY_LENGTH)])
_STATES: dict[str, JobState] = {"save-started": "saving", "save-finished": "training",
                                "waiting": "waiting", "resumed": "training", "stop": "stopped",
                                "finished": "finished"}


_JOBS = TypeAdapter(Annotated[list[Summary], Field(max_length=MAX_TRACKED_JOBS)])


def carries_a_save(kind: str, save: Optional[str]) -> bool:
    """A save, a durable checkpoint or its loss, or the final or top-up save starting:
    what a job's summary must never miss."""
    return kind in SAVE_KINDS or save in ("final", "top-up", "drill")


# Told of each batch posted, kept or not, and when (EventHistory.listen).
Listener = Callable[[list[JobEvent], float], None]


class EventHistory:
    """The node's bounded history of job events, its summary and its counters.

    Thread-safe: the API adds and reads in the event loop, the state file's writer takes
    :meth:`dump`, a scrape calls :meth:`collect`. ``on_change`` is told when events were
    kept (from the event loop: it must be cheap; the daemon's is ``StateFile.changed``).
    """

    # The state file's section (sidecar.host.statefile.Section): optional, so a bad one
    # is ignored and the deadline beside it still restored.
    name = EVENTS_STATE_KEY
    what = "the job events"
    required = False

    def __init__(
        self,
        *,
        length: int = HISTORY_LENGTH,
        rate_per_second: float = RATE_PER_SECOND,
        burst: float = BURST_EVENTS,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        on_change: Optional[Callable[[], None]] = None,
    ) -> None:
        self._lock = threading.Lock()
        self._clock = clock
        self._on_change = on_change
        self._listeners: list[Listener] = []
        self._length = length
        self._events: deque[dict[str, Any]] = deque()  # oldest first, at most length
        self._held: dict[str, int] = {}  # events in the history per job, oldest job first
        self._jobs: OrderedDict[str, Summary] = OrderedDict()  # least recently heard first
        self._featured: Optional[str] = None  # the job of the newest save or durability
        self._last_steps: OrderedDict[tuple[str, Optional[int]], int] = OrderedDict()
        self._job_buckets: KeyedBuckets[str] = KeyedBuckets(
            rate_per_second, burst, MAX_TRACKED_PEERS, monotonic)
        self._peer_buckets: KeyedBuckets[Optional[str]] = KeyedBuckets(
            rate_per_second * PEER_FACTOR, burst * PEER_FACTOR, MAX_TRACKED_PEERS, monotonic)
        self._save_buckets: KeyedBuckets[str] = KeyedBuckets(
            SAVE_RATE_PER_SECOND, SAVE_BURST_EVENTS, MAX_TRACKED_PEERS, monotonic)
        self._received = 0
        self._dropped = {"rate": 0}
        self._rejected = {"invalid": 0, "too-large": 0}
        self._flagged = {"step-backwards": 0}

    # ------------------------------------------------------------------ writers

    def add(self, events: Iterable[JobEvent], now: Optional[float] = None,
            peer: Optional[str] = None) -> dict[str, int]:
        """Keep validated events, oldest first, within the rates of their job and of the
        ``peer`` that sent them (its address); the counts of each fate. Every listener is
        handed the batch too, each event kept or not (:meth:`listen`)."""
        events = list(events)
        now = self._clock() if now is None else now
        accepted = dropped = flagged = 0
        with self._lock:
            for event in events:
                if not self._admit(event, peer):
                    dropped += 1
                    continue
                record = event.model_dump(exclude_none=True)
                record.setdefault("at_unix", now)
                record["received_at_unix"] = now
                flag = self._check_step(event)
                if flag is not None:
                    record["flag"] = flag
                    flagged += 1
                self._keep(record, saved=carries_a_save(event.kind, event.save))
                accepted += 1
            self._received += accepted
            self._dropped["rate"] += dropped
            self._flagged["step-backwards"] += flagged
        if accepted and self._on_change is not None:
            self._on_change()
        for listener in self._listeners:
            listener(events, now)
        return {"accepted": accepted, "dropped": dropped, "flagged": flagged}

    def listen(self, listener: Listener) -> None:
        """Hand each batch posted to ``listener(events, now)`` after it was taken in (the
        fire drills read the guards' reports there: ``features.drills``)."""
        self._listeners.append(listener)

    def _admit(self, event: JobEvent, peer: Optional[str]) -> bool:
        """Whether the event is within its rates: a save or durability its job's bucket of
        those; any other both its job's bucket and its peer's."""
        if carries_a_save(event.kind, event.save):
            return self._save_buckets.bucket(event.job).take()
        job, sender = self._job_buckets.bucket(event.job), self._peer_buckets.bucket(peer)
        if not (job.ready() and sender.ready()):
            return False
        job.spend()
        sender.spend()
        return True

    def _keep(self, record: dict[str, Any], saved: bool) -> None:
        """Into the history and the job's state. A full history gives up one event of the
        job holding the most: its oldest without a save, else its oldest."""
        job = record["job"]
        self._events.append(record)
        self._held[job] = self._held.get(job, 0) + 1
        while len(self._events) > self._length:
            self._give_up(max(self._held, key=self._held.__getitem__))
        state = self._jobs.pop(job, None) or Summary()
        self._jobs[job] = _summarised(state, record)
        while len(self._jobs) > MAX_TRACKED_JOBS:
            self._jobs.popitem(last=False)
        if saved:
            self._featured = job

    def _give_up(self, job: str) -> None:
        first = None
        for index, record in enumerate(self._events):
            if record["job"] == job:
                if first is None:
                    first = index
                if not carries_a_save(record["kind"], record.get("save")):
                    first = index
                    break
        assert first is not None  # the job holds an event: _held counts them
        del self._events[first]
        self._held[job] -= 1
        if not self._held[job]:
            del self._held[job]

    def _summary(self) -> Summary:
        """The summary served and exported: the job of the newest save or durability (a
        flood of other events by another job cannot take it), else the newest heard."""
        if self._featured is not None and self._featured in self._jobs:
            return self._jobs[self._featured]
        return next(reversed(self._jobs.values()), Summary())

    def reject(self, reason: str) -> None:
        """Count a request refused whole (422: ``invalid``, 413: ``too-large``)."""
        with self._lock:
            self._rejected[reason] += 1

    def _check_step(self, event: JobEvent) -> Optional[str]:
        """Steps of one job and rank go forward; a save at an older step is kept (a job may
        roll back to an earlier checkpoint after a loss spike) but flagged."""
        if event.step is None or event.kind not in ("save-started", "save-finished"):
            return None
        key = (event.job, event.rank)
        last = self._last_steps.pop(key, None)
        self._last_steps[key] = event.step if last is None else max(last, event.step)
        while len(self._last_steps) > MAX_TRACKED_JOBS:
            self._last_steps.popitem(last=False)
        if last is not None and event.step < last:
            return f"step went backwards: {event.step} after {last}"
        return None

    # ------------------------------------------------------------------ readers

    def body(self, limit: int = 100, now: Optional[float] = None) -> dict[str, Any]:
        """The ``GET /v1/events`` body: the summary, then the newest ``limit`` events."""
        now = self._clock() if now is None else now
        with self._lock:
            newest = [dict(e) for e in list(reversed(self._events))[: max(0, limit)]]
            length, summary = len(self._events), self._summary()
            jobs = list(reversed(self._jobs.values()))
            counts = {"received_total": self._received, "dropped": dict(self._dropped),
                      "rejected": dict(self._rejected), "flagged": dict(self._flagged)}
        return {"summary": _served_summary(summary, now), "events": newest,
                "jobs": [_served_summary(job, now) for job in jobs],
                "history_length": length, "history_capacity": self._length,
                **counts, "server_time_unix": now}

    def collect(self) -> list[Metric]:
        """Prometheus metrics at scrape time (registered in the API's own registry)."""
        with self._lock:
            summary = self._summary()
            received, dropped = self._received, dict(self._dropped)
            rejected, flagged = dict(self._rejected), dict(self._flagged)
        gauges = []
        # Times as Unix timestamps, not ages (Prometheus' convention): the age is
        # time() - the gauge in PromQL, right between scrapes too.
        for name, text, value in (
            ("last_save_timestamp_seconds", "Unix time a job on this node last finished a "
             "save", summary.last_save_at_unix),
            ("last_save_step", "Step of the last save a job finished", summary.last_save_step),
            ("last_save_duration_seconds", "Seconds that save blocked training (an "
             "asynchronous save writes on after)", summary.last_save_seconds),
            ("last_durable_step", "Step of the last final or top-up checkpoint a job saw "
             "durable", summary.last_durable_step),
            ("budget_seconds", "The save budget of the job's last decision (step + save + "
             "upload + margin)", summary.budget_seconds),
            ("deadline_timestamp_seconds", "Unix time of the deadline as the job saw it at "
             "its last decision (compare esi_sidecar_deadline_timestamp_seconds)",
             _job_deadline(summary)),
        ):
            gauge = GaugeMetricFamily(f"esi_sidecar_job_{name}", text + " (absent before one)")
            if value is not None:
                gauge.add_metric([], float(value))
            gauges.append(gauge)
        received_metric = CounterMetricFamily(
            "esi_sidecar_events_received", "Job events accepted: valid and within the rate "
            "limit (the history keeps the newest; dropped and refused ones are counted apart)")
        received_metric.add_metric([], received)
        dropped_metric = CounterMetricFamily(
            "esi_sidecar_events_dropped", "Valid job events not accepted, by reason (rate: "
            "over the rate limit)", labels=["reason"])
        flagged_metric = CounterMetricFamily(
            "esi_sidecar_events_flagged", "Job events accepted but flagged, by reason "
            "(step-backwards: a save at an older step than the same job and rank's last)",
            labels=["reason"])
        rejected_metric = CounterMetricFamily(
            "esi_sidecar_event_requests_rejected", "POST /v1/events requests refused whole, "
            "by reason: invalid (422) or too-large (413)", labels=["reason"])
        for metric, counts in ((dropped_metric, dropped), (flagged_metric, flagged),
                               (rejected_metric, rejected)):
            for reason, count in counts.items():
                metric.add_metric([reason], count)
        return [*gauges, received_metric, dropped_metric, flagged_metric, rejected_metric]

    # ------------------------------------------------------------------ state file

    def dump(self) -> dict[str, Any]:
        """The state file's ``events`` section: the history, the summary and the state of
        each job (least recently heard first)."""
        with self._lock:
            return {"version": STATE_VERSION, "history": list(self._events),
                    "summary": self._summary().model_dump(exclude_none=True),
                    "jobs": [job.model_dump(exclude_none=True) for job in self._jobs.values()]}

    def load(self, section: Any) -> None:
        """Load a section written by :meth:`dump`; ValueError naming the first bad field.
        All or nothing, and only into an empty history. A section without ``jobs`` (written
        before issue 22) has them rebuilt from its history, its summary's job as saved."""
        if not isinstance(section, dict):
            raise ValueError("not an object")
        if section.get("version") != STATE_VERSION:
            raise ValueError(f"unknown version {reprlib.repr(section.get('version'))}")
        unknown = set(section) - {"version", "history", "summary", "jobs"}
        if unknown:
            raise ValueError(f"unknown field(s) {', '.join(sorted(unknown))}")
        try:
            stored = _STORED.validate_python(section.get("history", []))
            summary = Summary.model_validate(section.get("summary", {}))
            jobs = _JOBS.validate_python(section.get("jobs", []))
        except ValidationError as exc:
            raise ValueError(_first_problem(exc)) from None
        for index, job in enumerate(jobs):
            if job.job is None:
                raise ValueError(f"jobs[{index}].job: missing")
        with self._lock:
            if self._events or self._jobs:
                return
            for event in stored:
                record = event.model_dump(exclude_none=True)
                self._events.append(record)
                self._held[event.job] = self._held.get(event.job, 0) + 1
                if event.step is not None and event.kind in ("save-started", "save-finished"):
                    key = (event.job, event.rank)
                    self._last_steps[key] = max(event.step, self._last_steps.pop(key, 0))
            while len(self._events) > self._length:
                self._give_up(max(self._held, key=self._held.__getitem__))
            while len(self._last_steps) > MAX_TRACKED_JOBS:
                self._last_steps.popitem(last=False)
            self._jobs = OrderedDict((job.job, job) for job in jobs if job.job is not None)
            if "jobs" not in section:
                self._rebuild_jobs(summary)
            saved = summary.last_save_at_unix is not None or (
                summary.last_durable_at_unix is not None)
            self._featured = summary.job if saved else self._featured

    def _rebuild_jobs(self, summary: Summary) -> None:
        """The jobs' states of a section written before they were kept: from its history,
        and its summary as its job's."""
        for record in self._events:
            state = self._jobs.pop(record["job"], None) or Summary()
            self._jobs[record["job"]] = _summarised(state, record)
            if carries_a_save(record["kind"], record.get("save")):
                self._featured = record["job"]
        if summary.job is not None:
            self._jobs.pop(summary.job, None)
            self._jobs[summary.job] = summary
        while len(self._jobs) > MAX_TRACKED_JOBS:
            self._jobs.popitem(last=False)


def _summarised(summary: Summary, record: dict[str, Any]) -> Summary:
    """A job's state after one more of its events."""
    summary = summary.model_copy()
    kind, at = record["kind"], record["at_unix"]
    summary.job, summary.rank, summary.last_event_at_unix = (
        record["job"], record.get("rank"), at)
    summary.state = _STATES.get(kind, summary.state)
    if kind == "save-finished":
        summary.last_save_step = record.get("step")
        summary.last_save = record.get("save")
        summary.last_save_at_unix, summary.last_save_seconds = at, record["seconds"]
    elif kind == "durable" and record.get("step") is not None:
        summary.last_durable_step, summary.last_durable_at_unix = record["step"], at
    if "remaining_seconds" in record:
        summary.remaining_seconds, summary.decision_at_unix = record["remaining_seconds"], at
    for field in ("step_seconds", "save_seconds", "budget_seconds"):
        if field in record:
            setattr(summary, field, record[field])
    return summary


def _job_deadline(summary: Summary) -> Optional[float]:
    if summary.remaining_seconds is None or summary.decision_at_unix is None:
        return None
    return summary.decision_at_unix + summary.remaining_seconds


def _served_summary(summary: Summary, now: float) -> dict[str, Any]:
    body = summary.model_dump()
    for field, at in (("last_save_age_seconds", summary.last_save_at_unix),
                      ("last_durable_age_seconds", summary.last_durable_at_unix),
                      ("decision_age_seconds", summary.decision_at_unix)):
        body[field] = None if at is None else max(0.0, now - at)
    return body


def _first_problem(exc: ValidationError) -> str:
    return problem_line(exc.errors(include_url=False, include_input=False,
                                   include_context=False)[0])


def problem_line(error: Mapping[str, Any]) -> str:
    """One of pydantic's errors as one line: ``[1].seconds: <message>``."""
    return f"{_where(error['loc'])}: {error['msg']}"


def _where(loc: tuple[Any, ...]) -> str:
    """``(1, "seconds")`` -> ``[1].seconds``; ``("seconds",)`` -> ``seconds``."""
    text = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc)
    return text.lstrip(".") or "body"
