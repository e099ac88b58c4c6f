"""When to ask the cloud API next: rarely while the release is far, as often as before
near it; and a hard cap on the calls one host makes.

Every host of a customer polls the same account, and the account's API rate is shared:
1,000 hosts polling every 30 s make 33 calls a second, and throttling then delays the very
answers that matter. A release hours ahead cannot become urgent between two polls unless
the service moves it, so the staleness accepted is a fraction of the time left
(:data:`FAR_FRACTION`: 5 min at 1 h, 10 min at 2 h, at most :data:`MAX_INTERVAL_SECONDS`),
and the last :data:`NEAR_SECONDS` before the release are polled at ``--poll-interval`` as
always. A far interval never steps over the start of that window: the poll it plans
lands at or before it. The reasoning and the figures: docs/polling.md.
"""

from __future__ import annotations

import math
import random
import threading
import time
from typing import Callable, Optional

__all__ = [
    "DEFAULT_MAX_API_RATE",
    "FAR_FRACTION",
    "MAX_INTERVAL_SECONDS",
    "NEAR_SECONDS",
    "NO_DEADLINE_INTERVAL_SECONDS",
    "ApiBudget",
    "adaptive_interval",
    "jittered",
    "retry_cap",
]

# Which sources follow this schedule, and which count against --max-api-rate, each
# source's spec says (SourceTraits: adaptive, api_budget).

FAR_FRACTION = 1 / 12  # of the time left: 12 calls an hour at most while >= 1 h away
MAX_INTERVAL_SECONDS = 900.0
NEAR_SECONDS = 900.0  # the final 15 minutes: every --poll-interval, as before
NO_DEADLINE_INTERVAL_SECONDS = 300.0  # no release known (not an ESI instance, or none yet)
# Calls per host-hour, all API sources together: 3 x what the defaults make in the final
# window (two sources every 30 s), so it only bites on a retry storm or a short interval.
DEFAULT_MAX_API_RATE = 720.0


def adaptive_interval(remaining: Optional[float], base: float) -> float:
    """Seconds to the next poll of a release ``remaining`` seconds away (None: none known),
    never less than ``base`` (the --poll-interval)."""
    if remaining is None or math.isnan(remaining):
        return max(base, NO_DEADLINE_INTERVAL_SECONDS)
    if remaining <= NEAR_SECONDS:
        return base
    far = min(MAX_INTERVAL_SECONDS, FAR_FRACTION * remaining, remaining - NEAR_SECONDS)
    return max(base, far)


def retry_cap(remaining: Optional[float], base: float) -> float:
    """The longest wait between retries after failures (throttling above all) of a source
    on the adaptive schedule: its planned interval. A host whose release is hours away
    then retries rarely, and the account's calls go to the hosts whose release is near.
    Without a known release: ``base``, so a first answer is not put off."""
    if remaining is None:
        return base
    return adaptive_interval(remaining, base)


def jittered(interval: float, base: float, rng: random.Random) -> float:
    """``interval`` less up to 10 % (never more: a planned poll must not step over the
    final window), so a fleet that started together does not poll in step. The base
    interval keeps its +-10 %."""
    if interval <= base:
        return interval * rng.uniform(0.9, 1.1)
    return max(base, interval * rng.uniform(0.9, 1.0))


class ApiBudget:
    """A token bucket of API calls for one daemon: ``rate`` per hour, bursts of a minute's
    worth (at least 2). :meth:`wait` says how long a poll must wait for its call; the
    sources' threads share one budget. Thread-safe."""

    def __init__(self, rate_per_hour: float,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        if not (math.isfinite(rate_per_hour) and rate_per_hour > 0):
            raise ValueError(f"rate must be > 0 calls per hour, got {rate_per_hour!r}")
        self.rate_per_hour = rate_per_hour
        self._per_second = rate_per_hour / 3600.0
        self._capacity = max(2.0, rate_per_hour / 60.0)
        self._tokens = self._capacity
        self._monotonic = monotonic
        self._updated = monotonic()
        self._lock = threading.Lock()
        #: Calls that had to wait for the budget, and for how long in all.
        self.deferred = 0
        self.deferred_seconds = 0.0

    def take(self) -> float:
        """Reserve one call; seconds to wait before making it (0: now)."""
        with self._lock:
            now = self._monotonic()
            self._tokens = min(self._capacity,
                               self._tokens + (now - self._updated) * self._per_second)
            self._updated = now
            self._tokens -= 1.0
            if self._tokens >= 0:
                return 0.0
            wait = -self._tokens / self._per_second
            self.deferred += 1
            self.deferred_seconds += wait
            return wait
