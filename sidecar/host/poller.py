"""Drives every source on its own schedule and writes the results into the store.

One thread per source, so a slow API call never delays another source. Success: wait the
poll interval +-10 %. Failure: retry after 1 s, doubling, capped at the poll interval,
each with +-20 % jitter so a fleet of hosts does not retry in step; throttling backs off
the same way but starts higher. Shutdown is a flag (an Event) that every wait checks.

A deadline that changed is told to ``on_change`` (the daemon's: the state file's write,
``sidecar.host.statefile``); the poller itself never reads or writes a file.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Callable, Optional

from sidecar.host.schedule import (
    ApiBudget,
    adaptive_interval,
    jittered,
    retry_cap,
)
from sidecar.host.sources.base import (
    Observation,
    Source,
    SourceAbsent,
    SourceError,
    SourceRefused,
    SourceTraits,
    where,
)
from sidecar.host.store import Store, describe_passed, long_past
from sidecar.timeparse import format_rfc3339

__all__ = ["Poller", "next_delay"]

log = logging.getLogger("sidecar.host.poller")

FIRST_RETRY_SECONDS = 1.0
FIRST_THROTTLED_RETRY_SECONDS = 4.0


def next_delay(
    interval: float, failures: int, *, throttled: bool = False, rng: random.Random
) -> float:
    """Seconds until the next poll after ``failures`` consecutive failures (0: success)."""
    if failures == 0:
        return interval * rng.uniform(0.9, 1.1)
    first = FIRST_THROTTLED_RETRY_SECONDS if throttled else FIRST_RETRY_SECONDS
    backoff = min(interval, first * 2 ** min(failures - 1, 30))
    return backoff * rng.uniform(0.8, 1.2)


# A deadline that disappears from a source's answer is suspect (an instance does not stop
# being an ESI instance between two polls; an empty AutoReleaseAt may be a glitch): the
# last one is kept, and said to be kept, until this many polls in a row confirm it gone.
# Those confirming polls come sooner than the interval, at most CONFIRM_DELAY_SECONDS apart.
VANISHED_CONFIRMATIONS = 3
CONFIRM_DELAY_SECONDS = 5.0
_PLAIN = SourceTraits()


class Poller:
    def __init__(
        self,
        sources: Sequence[Source],
        store: Store,
        *,
        interval: float,
        rng: Optional[random.Random] = None,
        clock: Callable[[], float] = time.time,
        on_change: Optional[Callable[[], None]] = None,
        adaptive: bool = True,
        budget: Optional[ApiBudget] = None,
        traits: Optional[Mapping[str, SourceTraits]] = None,
    ) -> None:
        self._sources = list(sources)
        self._store = store
        self._interval = interval
        self._rng = rng or random.Random()
        self._clock = clock
        self._on_change = on_change  # called in the poll thread when a deadline changed
        # The far-release schedule (sidecar.host.schedule) for the sources that have one,
        # and the cap on the OpenAPI calls of this host (None: none).
        self._adaptive = adaptive
        self.budget = budget
        self._said_budget = False
        # What each source's spec says of it, by name (sidecar.host.sources.spec); a source
        # not named follows --poll-interval on the fixed schedule, outside the budget.
        self._traits = dict(traits or {})
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._attempted: set[str] = set()
        self._attempt_lock = threading.Lock()
        self._last_logged_error: dict[str, Optional[str]] = {}
        self._vanished: dict[str, int] = {}  # polls in a row without the known deadline
        self._last_absent: dict[str, str] = {}  # why auto found a source absent, as logged
        self._said_zone: dict[str, str] = {}  # the zone read into offset-less times, as logged
        self._said_past: dict[str, set[tuple[str, float]]] = {}  # long-past deadlines logged
        #: Set once every source has been polled at least once (systemd READY=1).
        self.first_attempt_done = threading.Event()

    # ------------------------------------------------------------------ one poll

    def poll_once(self, source: Source) -> float:
        """Poll one source, record the result, say when it changed; return the next delay."""
        try:
            observation = source.poll()
        except SourceAbsent as exc:  # --source auto: not on this machine (asked again later)
            reason = _one_line(str(exc))
            self._store.record_absent(source.name, reason)
            if self._last_absent.get(source.name) != reason:
                log.info("source %s does not run here: %s", source.name, reason)
                self._last_absent[source.name] = reason
            self._mark_attempted(source.name)
            return exc.retry_after if exc.retry_after is not None else self._interval_of(source)
        except SourceError as exc:
            message = _one_line(str(exc))
            self._store.record_failure(source.name, message, throttled=exc.throttled,
                                       refused=isinstance(exc, SourceRefused))
            self._log_failure(source.name, message)
            failures = self._failures(source.name)
            delay = next_delay(self._retry_cap(source), failures, throttled=exc.throttled,
                               rng=self._rng)
        except Exception as exc:  # a bug in a source must not kill its thread
            # Only the type and the place: a source scrubs secrets from its SourceErrors,
            # but an unexpected exception's text is unvetted, so it is neither served nor
            # logged.
            kind = type(exc).__name__
            message = f"internal error in the {source.name} source: {kind} {where(exc)}"
            self._store.record_failure(source.name, message)
            log.error("%s; please report it", message)
            self._last_logged_error[source.name] = message
            delay = next_delay(self._interval_of(source), self._failures(source.name),
                               rng=self._rng)
        else:
            if self._suspect(source.name, observation):
                count = self._vanished[source.name]
                message = (f"the deadline disappeared from the answer ({count} of "
                           f"{VANISHED_CONFIRMATIONS} polls): the last known one is kept until "
                           "it is confirmed gone")
                self._store.record_failure(source.name, message)
                self._log_failure(source.name, message.split(" (")[0])
                delay = min(self._interval_of(source), CONFIRM_DELAY_SECONDS)
                self._mark_attempted(source.name)
                return delay
            self._vanished[source.name] = 0
            changed = self._store.record_success(source.name, observation)
            if self._last_logged_error.get(source.name):
                log.info("source %s recovered", source.name)
            self._last_logged_error[source.name] = None
            if changed:
                log.info("source %s: %s", source.name, _describe(observation))
                if self._on_change is not None:
                    self._on_change()
            self._say_zone(source.name, observation.assumed_timezone)
            self._say_past(source.name, observation)
            delay = self._next_success_delay(source, observation)
        self._mark_attempted(source.name)
        return delay

    def _retry_cap(self, source: Source) -> float:
        """The longest wait between retries: the planned interval of the last known
        release for the adaptive sources (a far host that is throttled waits its turn, and
        leaves the account's calls to the hosts whose release is near), else the
        interval."""
        base = self._interval_of(source)
        if not self._adaptive or not self._traits_of(source).adaptive:
            return base
        status = next(s for s in self._store.snapshot().sources if s.name == source.name)
        when = None if status.observation is None else status.observation.expires_at_unix
        return retry_cap(None if when is None else when - self._clock(), base)

    def _next_success_delay(self, source: Source, observation: Observation) -> float:
        base = self._interval_of(source)
        if not self._adaptive or not self._traits_of(source).adaptive:
            return next_delay(base, 0, rng=self._rng)
        when = observation.expires_at_unix
        remaining = None if when is None else when - self._clock()
        interval = adaptive_interval(remaining, base)
        self._store.plan_next_poll(source.name, interval - base)
        return jittered(interval, base, self._rng)

    def _say_zone(self, name: str, zone: Optional[str]) -> None:
        """Once per source and zone: a time came without an offset and was read in ``zone``
        (the source's platform's, the earliest plausible, unless --timezone set one)."""
        if zone and self._said_zone.get(name) != zone:
            log.warning("source %s gave a time without a UTC offset: read as %s (the "
                        "source's own zone unless --timezone sets one)", name, zone)
            self._said_zone[name] = zone

    def _say_past(self, name: str, observation: Observation) -> None:
        """Once per source and deadline: it passed long ago and this machine still runs
        (served, marked in ``error`` and /healthz; the store decides)."""
        now = self._clock()
        past = long_past(observation, now)
        said = self._said_past.get(name, set())
        for notice in past:
            if (notice.kind, notice.expires_at_unix or 0.0) not in said:
                log.warning("source %s: %s", name, describe_passed(notice, now))
        self._said_past[name] = {(n.kind, n.expires_at_unix or 0.0) for n in past}

    def _interval_of(self, source: Source) -> float:
        """A source that must be polled on its own cadence says so (the aws source: every
        2 s, for a two-minute notice); the others follow --poll-interval."""
        own = self._traits_of(source).poll_interval_seconds
        return float(own) if own else self._interval

    def _traits_of(self, source: Source) -> SourceTraits:
        return self._traits.get(source.name, _PLAIN)

    def _suspect(self, name: str, observation: Observation) -> bool:
        """A successful poll without a deadline, where one was known: suspect until
        VANISHED_CONFIRMATIONS polls in a row say so."""
        if observation.expires_at_unix is not None:
            return False
        status = next(s for s in self._store.snapshot().sources if s.name == name)
        known = status.observation
        if known is None or known.expires_at_unix is None:
            return False
        self._vanished[name] = self._vanished.get(name, 0) + 1
        return self._vanished[name] < VANISHED_CONFIRMATIONS

    def _mark_attempted(self, name: str) -> None:
        with self._attempt_lock:
            self._attempted.add(name)
            if len(self._attempted) == len(self._sources):
                self.first_attempt_done.set()

    def _failures(self, name: str) -> int:
        status = next(s for s in self._store.snapshot().sources if s.name == name)
        return status.consecutive_failures

    def _log_failure(self, name: str, message: str) -> None:
        # One line per change of error, not one per retry.
        if self._last_logged_error.get(name) != message:
            log.warning("source %s: poll failed: %s", name, message)
            self._last_logged_error[name] = message

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self._stop.clear()
        for source in self._sources:
            thread = threading.Thread(
                target=self._run, args=(source,), name=f"poll-{source.name}", daemon=True
            )
            thread.start()
            self._threads.append(thread)

    def _run(self, source: Source) -> None:
        while not self._stop.is_set():
            if not self._wait_for_budget(source):
                return
            delay = self.poll_once(source)
            self._store.record_next_poll(source.name, delay)  # how late a move is seen
            self._stop.wait(delay)

    def _wait_for_budget(self, source: Source) -> bool:
        """Wait until this host's API budget allows the call; False when stopped."""
        if self.budget is None or not self._traits_of(source).api_budget:
            return True
        wait = self.budget.take()
        if wait > 0:
            if not self._said_budget:
                log.warning("--max-api-rate (%g calls per hour) reached: the next OpenAPI "
                            "call waits %.0f s (said once)", self.budget.rate_per_hour, wait)
                self._said_budget = True
            return not self._stop.wait(wait)
        return True

    def alive(self) -> bool:
        """True while every poll thread runs (the systemd watchdog pings only then)."""
        return bool(self._threads) and all(thread.is_alive() for thread in self._threads)

    def request_stop(self) -> None:
        """Ask the loops to end after their current poll, without waiting."""
        self._stop.set()

    def stop(self, timeout: float = 4.0) -> None:
        """Stop the loops. A poll in flight is not waited for past ``timeout`` (its
        threads are daemons; the SDK's own timeout bounds it)."""
        self._stop.set()
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        self._threads.clear()


def _one_line(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _describe(observation: Observation) -> str:
    if observation.expires_at_unix is None:
        return "no scheduled release"
    return f"deadline {format_rfc3339(observation.expires_at_unix)} ({observation.kind})"
