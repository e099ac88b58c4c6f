"""Current state per source, behind one lock. Readers get frozen copies.

The store schedules nothing and does no I/O: the poller writes, the API reads. It turns
per-source state into the ``/v1/expiry`` body (the earliest known deadline wins) and the
``/healthz`` verdict. Deadlines are absolute Unix times; ages are measured on the wall
clock because the last good state survives restarts through the state file.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

from sidecar.models import Expiry, Notice, Observation
from sidecar.timeparse import format_rfc3339

__all__ = ["MOVES_KEPT", "NO_SOURCE_RUNS", "OUTCOMES", "PAST_GRACE_SECONDS",
           "START_GRACE_SECONDS", "DeadlineMove", "Health", "Snapshot", "SourceStatus", "Store",
           "build_expiry", "build_health", "build_notices", "describe_passed", "detection_lag",
           "long_past", "not_working", "start_grace"]

OUTCOMES = ("ok", "error", "throttled")
# The start of /healthz's reason when --source auto runs nothing on this machine.
NO_SOURCE_RUNS = "no deadline source can run here"


MOVES_KEPT = 100
# /healthz says "starting" at most this long after start-up (or the staleness bound, when
# shorter): a first poll answers within seconds, and a source that cannot be reached (its
# metadata refusing connections, say) is degraded, with the reason, from then on.
START_GRACE_SECONDS = 30.0


@dataclass(frozen=True)
class DeadlineMove:
    """A source's deadline learned (``before`` None on the first answer) or moved."""

    source: str
    at_unix: float
    before_unix: Optional[float]
    after_unix: Optional[float]
    kind: Optional[str]


@dataclass(frozen=True)
class SourceStatus:
    name: str
    observation: Optional[Observation] = None  # the last good one
    observed_at_unix: Optional[float] = None  # when it was last confirmed by a poll
    restored: bool = False  # came from the state file; not yet confirmed by this process
    error: Optional[str] = None  # last poll's error; None after a success
    # The last poll's error is a refusal that waiting will not mend (no credentials,
    # credentials refused, an action not allowed): degraded at once, never "starting".
    refused: bool = False
    last_attempt_unix: Optional[float] = None
    consecutive_failures: int = 0
    polls: tuple[tuple[str, int], ...] = tuple((outcome, 0) for outcome in OUTCOMES)
    # --source auto: why this source does not run on this machine (None: it runs, or its
    # probe has not answered yet). An absent source counts for nothing.
    absent: Optional[str] = None
    # How much later than --poll-interval the next poll is planned (the adaptive schedule
    # of a far release, sidecar.host.schedule): staleness waits that much longer.
    poll_slack: float = 0.0
    # The wait planned after the last poll: how late a moved deadline can be seen now
    # (served as ``detection_lag_seconds``; None before the first poll).
    next_poll_seconds: Optional[float] = None
    # Whose end its deadlines are ("machine" | "process"), as its spec declares; served as
    # ``deadline_kind`` (None: not said, a store built without the specs).
    deadline_kind: Optional[str] = None

    def age(self, now: float) -> Optional[float]:
        return None if self.observed_at_unix is None else now - self.observed_at_unix

    def is_fresh(self, now: float, stale_after: float) -> bool:
        age = self.age(now)
        return not self.restored and age is not None and age <= stale_after + self.poll_slack


@dataclass(frozen=True)
class Snapshot:
    sources: tuple[SourceStatus, ...]
    stale_after: float
    started_at_unix: float

    @property
    def present(self) -> tuple[SourceStatus, ...]:
        """The sources that count: all but those --source auto found absent."""
        return tuple(status for status in self.sources if status.absent is None)


@dataclass(frozen=True)
class Health:
    status: str  # "ok" | "starting" | "degraded"
    reason: Optional[str]

    @property
    def ok(self) -> bool:
        return self.status == "ok"


class Store:
    def __init__(
        self,
        source_names: Sequence[str],
        *,
        stale_after: float,
        clock: Callable[[], float] = time.time,
        deadline_kinds: Optional[Mapping[str, str]] = None,
    ) -> None:
        """``deadline_kinds``: each source's deadline kind by name (its spec's)."""
        if not source_names:
            raise ValueError("a store needs at least one source")
        self._lock = threading.Lock()
        self._clock = clock
        self._stale_after = stale_after
        self._started = clock()
        kinds = deadline_kinds or {}
        self._sources = {name: SourceStatus(name, deadline_kind=kinds.get(name))
                         for name in source_names}
        # Each source's deadline as it was learned and as it moved, newest last (bounded).
        self._moves: deque[DeadlineMove] = deque(maxlen=MOVES_KEPT)

    # ------------------------------------------------------------------ writers

    def record_success(
        self, name: str, observation: Observation, at: Optional[float] = None
    ) -> bool:
        """Keep a good poll. Returns True when the observation differs from the last one."""
        at = self._clock() if at is None else at
        with self._lock:
            old = self._sources[name]
            before = None if old.observation is None else old.observation.expires_at_unix
            if before != observation.expires_at_unix or old.observation is None:
                self._moves.append(DeadlineMove(name, at, before, observation.expires_at_unix,
                                                observation.kind))
            self._sources[name] = replace(
                old,
                observation=observation,
                observed_at_unix=at,
                restored=False,
                error=None,
                last_attempt_unix=at,
                consecutive_failures=0,
                polls=_count(old.polls, "ok"),
                absent=None,
                refused=False,
            )
        return old.observation != observation

    def record_failure(
        self, name: str, message: str, *, throttled: bool = False, refused: bool = False,
        at: Optional[float] = None,
    ) -> None:
        """Keep the error; the last good observation stays served. ``refused``: a refusal
        that waiting will not mend (``sources.base.SourceRefused``)."""
        at = self._clock() if at is None else at
        with self._lock:
            old = self._sources[name]
            self._sources[name] = replace(
                old,
                error=message,
                last_attempt_unix=at,
                consecutive_failures=old.consecutive_failures + 1,
                polls=_count(old.polls, "throttled" if throttled else "error"),
                refused=refused,
            )

    def plan_next_poll(self, name: str, slack_seconds: float) -> None:
        """The next poll of ``name`` comes ``slack_seconds`` later than --poll-interval
        would have it: its answer counts as fresh that much longer."""
        with self._lock:
            self._sources[name] = replace(self._sources[name],
                                          poll_slack=max(0.0, slack_seconds))

    def record_next_poll(self, name: str, delay_seconds: float) -> None:
        """The poller waits ``delay_seconds`` before it asks ``name`` again."""
        with self._lock:
            self._sources[name] = replace(self._sources[name],
                                          next_poll_seconds=max(0.0, delay_seconds))

    def record_absent(self, name: str, reason: str, at: Optional[float] = None) -> None:
        """The source's service is not on this machine: leave it out until it appears."""
        at = self._clock() if at is None else at
        with self._lock:
            self._sources[name] = replace(self._sources[name], absent=reason,
                                          last_attempt_unix=at, error=None, refused=False)

    def restore(self, name: str, observation: Observation, observed_at_unix: float) -> None:
        """Load a state saved by an earlier run; served as stale until a poll confirms it."""
        with self._lock:
            if name in self._sources and self._sources[name].observation is None:
                self._sources[name] = replace(
                    self._sources[name],
                    observation=observation,
                    observed_at_unix=observed_at_unix,
                    restored=True,
                )

    # ------------------------------------------------------------------ readers

    def moves(self) -> list[DeadlineMove]:
        """The deadlines learned and their moves, oldest first (at most MOVES_KEPT)."""
        with self._lock:
            return list(self._moves)

    def snapshot(self) -> Snapshot:
        with self._lock:
            sources = tuple(self._sources.values())  # frozen: safe to hand out
        return Snapshot(sources, self._stale_after, self._started)

    def expiry(self, now: Optional[float] = None) -> Expiry:
        now = self._clock() if now is None else now
        return build_expiry(self.snapshot(), now)

    def health(self, now: Optional[float] = None) -> Health:
        now = self._clock() if now is None else now
        return build_health(self.snapshot(), now)


def _count(polls: tuple[tuple[str, int], ...], outcome: str) -> tuple[tuple[str, int], ...]:
    return tuple((name, count + (name == outcome)) for name, count in polls)


def build_expiry(snapshot: Snapshot, now: float) -> Expiry:
    """The earliest known deadline across sources, with the freshness of the whole picture.

    ``stale`` is true when any source lacks a fresh success: a source we cannot hear from
    might hold an earlier deadline, and the client should know. ``observed_at`` is the
    oldest of the sources' last successes, for the same reason. Sources that --source auto
    found absent count for nothing.
    """
    present = snapshot.present
    good, past = _deadlines(present, now)
    # A deadline long past is served only when no other is known: hiding it would read as
    # "nothing scheduled", and the client must still see that the release is due (issue 13).
    chosen_notice, chosen = min(good or past, key=lambda pair: pair[0].expires_at_unix or 0.0,
                                default=(None, None))
    observed = [s.observed_at_unix for s in present if s.observed_at_unix is not None]
    observed_at = min(observed) if observed and len(observed) == len(present) else None
    errors = [(s.name, s.error) for s in present if s.error]
    errors += [(status.name, describe_passed(notice, now)
                + ("" if notice is chosen_notice else "; not served")) for notice, status in past]
    if len(snapshot.sources) == 1 and errors:
        error: Optional[str] = "; ".join(message for _, message in errors)
    else:
        error = "; ".join(f"{name}: {message}" for name, message in errors) or None
    stale = not all(s.is_fresh(now, snapshot.stale_after) for s in present)
    # Identity fields come from the source that gave the deadline, else from any that knows.
    identity = chosen or next((s for s in present if s.observation), None)
    observation = identity.observation if identity else None
    deadline = chosen_notice.expires_at_unix if chosen_notice else None
    return Expiry(
        expires_at=format_rfc3339(deadline) if deadline is not None else None,
        expires_at_unix=deadline,
        remaining_seconds=None if deadline is None else deadline - now,
        kind=chosen_notice.kind if chosen_notice else None,
        source=chosen.name if chosen else (identity.name if identity else None),
        instance_id=observation.instance_id if observation else None,
        scheduled_instance_id=observation.scheduled_instance_id if observation else None,
        observed_at=format_rfc3339(observed_at) if observed_at is not None else None,
        age_seconds=None if observed_at is None else max(0.0, now - observed_at),
        stale=stale,
        error=error,
        server_time_unix=now,
        assumed_timezone=(
            chosen.observation.assumed_timezone if chosen and chosen.observation else None
        ),
        notices=build_notices(present, now, snapshot.stale_after),
        detection_lag_seconds=detection_lag(present),
        deadline_kind=chosen.deadline_kind if chosen else None,
    )


def detection_lag(sources: Sequence[SourceStatus]) -> Optional[float]:
    """How late a moved deadline can be seen now: the longest wait the poller planned
    after its last poll of any of ``sources`` (None before one was polled). The adaptive
    schedule waits a twelfth of the time left while a release is far (docs/polling.md)."""
    planned = [s.next_poll_seconds for s in sources if s.next_poll_seconds is not None]
    return round(max(planned), 1) if planned else None


def not_working(status: SourceStatus, now: float, stale_after: float) -> Optional[str]:
    """Why ``status``'s source cannot be trusted for a verdict now, None when it works: it
    polled successfully in this process, it is not failing now (a failing poll while the
    last good answer is still fresh is a retry, not a failure yet), and no deadline is long
    past (a release that came while the machine runs: the answer, or the clock, is wrong)."""
    detail = f": {status.error}" if status.error else ""
    if status.observed_at_unix is None or status.restored:
        return f"no successful poll yet{detail}"
    if status.error and not status.is_fresh(now, stale_after):
        return f"no successful poll for {now - status.observed_at_unix:.0f} s{detail}"
    past = long_past(status.observation, now)
    if past:
        return describe_passed(past[0], now)
    return None


# A deadline this far in the past means the machine should be gone, so the source's answer
# or this host's clock is wrong: it is reported in ``error``, makes /healthz degraded, and
# is served only while no other deadline is known (a later good one must not hide behind
# it). Within the grace it is a release that just came, while the platform takes its time.
PAST_GRACE_SECONDS = 120.0


def _notices_of(status: SourceStatus) -> tuple[Notice, ...]:
    return _observation_notices(status.observation)


def _observation_notices(observation: Optional[Observation]) -> tuple[Notice, ...]:
    """A source's notices; one from its deadline when it lists none."""
    if observation is None:
        return ()
    if observation.notices:
        return observation.notices
    if observation.expires_at_unix is None:
        return ()
    return (Notice(observation.kind or "deadline", observation.expires_at_unix),)


def _deadlines(sources: Sequence[SourceStatus], now: float) -> tuple[
        list[tuple[Notice, SourceStatus]], list[tuple[Notice, SourceStatus]]]:
    """(deadlines to choose from, deadlines long past) over every source's notices."""
    good: list[tuple[Notice, SourceStatus]] = []
    past: list[tuple[Notice, SourceStatus]] = []
    for status in sources:
        for notice in _notices_of(status):
            if notice.advisory or notice.expires_at_unix is None:
                continue
            late = notice.expires_at_unix < now - PAST_GRACE_SECONDS
            (past if late else good).append((notice, status))
    return good, past


def long_past(observation: Optional[Observation], now: float) -> tuple[Notice, ...]:
    """The deadlines in ``observation`` more than PAST_GRACE_SECONDS before ``now``."""
    return tuple(notice for notice in _observation_notices(observation)
                 if not notice.advisory and notice.expires_at_unix is not None
                 and notice.expires_at_unix < now - PAST_GRACE_SECONDS)


def describe_passed(notice: Notice, now: float) -> str:
    """One line on a deadline long past (see PAST_GRACE_SECONDS)."""
    assert notice.expires_at_unix is not None
    ago = now - notice.expires_at_unix
    what = f"{notice.kind} ({notice.detail})" if notice.detail else notice.kind
    return (f"{what} at {format_rfc3339(notice.expires_at_unix)} passed {ago:.0f} s ago "
            "and this machine still runs: the source's answer or this host's clock is wrong")


def build_notices(sources: Sequence[SourceStatus], now: float,
                  stale_after: float) -> tuple[dict[str, Any], ...]:
    """Every notice of every source, the earliest deadline first, advice last: what the
    ``notices`` field of ``/v1/expiry`` lists. A source that lists none contributes its
    deadline as its one notice."""
    notices = [_notice_json(status, notice, now, stale_after)
               for status in sources for notice in _notices_of(status)]
    notices.sort(key=lambda n: (n["advisory"], n["expires_at_unix"] is None,
                                n["expires_at_unix"] or 0.0, n["source"]))
    return tuple(notices)


def _notice_json(status: SourceStatus, notice: Notice, now: float,
                 stale_after: float) -> dict[str, Any]:
    when = notice.expires_at_unix
    return {
        "source": status.name,
        "kind": notice.kind,
        "expires_at": None if when is None else format_rfc3339(when),
        "expires_at_unix": when,
        "remaining_seconds": None if when is None else when - now,
        "advisory": notice.advisory,
        "detail": notice.detail,
        "observed_at": (None if status.observed_at_unix is None
                        else format_rfc3339(status.observed_at_unix)),
        "stale": not status.is_fresh(now, stale_after),
        "detection_lag_seconds": (None if status.next_poll_seconds is None
                                  else round(status.next_poll_seconds, 1)),
        "deadline_kind": status.deadline_kind,
    }


def start_grace(stale_after: float) -> float:
    """How long after start-up a source without a successful poll is ``starting``, not
    ``degraded``: :data:`START_GRACE_SECONDS`, or the staleness bound when shorter."""
    return min(stale_after, START_GRACE_SECONDS)


def build_health(snapshot: Snapshot, now: float) -> Health:
    """ok: every source has a fresh success and no deadline is long past. starting: some
    source has not answered yet and the start-up grace (:func:`start_grace`) has not
    passed.
    degraded: anything else, at once when a source was refused (no credentials, say:
    waiting mends nothing) or when ``--source auto`` found no source that can run here
    (issue 26, item 4)."""
    if not snapshot.present:
        skipped = "; ".join(f"{s.name}: {s.absent}" for s in snapshot.sources)
        return Health("degraded", f"{NO_SOURCE_RUNS}: {skipped}")
    for status in snapshot.present:
        if status.is_fresh(now, snapshot.stale_after):
            continue
        waited = now - snapshot.started_at_unix
        never_polled_ok = status.restored or status.observed_at_unix is None
        if never_polled_ok and waited <= start_grace(snapshot.stale_after) and (
                not status.refused):
            detail = f": {status.error}" if status.error else ""
            return Health("starting", f"{status.name}: no successful poll yet{detail}")
        age = status.age(now)
        since = f"for {age:.0f} s" if age is not None and not status.restored else "since start"
        detail = f": {status.error}" if status.error else ""
        return Health("degraded", f"{status.name}: no successful poll {since}{detail}")
    past = _deadlines(snapshot.present, now)[1]
    if past:
        notice, status = past[0]
        return Health("degraded", f"{status.name}: {describe_passed(notice, now)}")
    return Health("ok", None)
