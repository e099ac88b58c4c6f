"""What the emulated cloud currently says, and which faults it is told to show.

Every read and write goes through one lock: the HTTP server answers on many threads
while a test changes the release time or injects a fault from another.
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any, Callable, Optional

__all__ = ["ERROR_FAULTS", "FAULT_KINDS", "EmulatorState", "Fault", "release_in"]

# Faults that replace the answer with an error (at most one applies to a request).
ERROR_FAULTS = ("throttle", "flow-limit", "server-error", "auth", "malformed-json",
                "forbidden", "invalid-action")
# Faults that change a successful answer, each for the requests it names.
_MODIFIER_SCOPE = {
    "slow": "api",
    "bad-release": "DescribeScheduledInstances",
    "empty-release": "DescribeScheduledInstances",
    "non-esi": "DescribeInstances",
    "metadata-down": "metadata",
    # The spot path only (/latest/spot_instance_termination_time): 500, an HTML page,
    # no answer for ``delay`` s, the answer a byte every ``delay`` s.
    "spot-down": "spot",
    "spot-garbage": "spot",
    "spot-slow": "spot",
    "spot-trickle": "spot",
}
FAULT_KINDS = ERROR_FAULTS + tuple(_MODIFIER_SCOPE)

# The ECS API writes times in China Standard Time with an explicit offset.
_CST = timezone(timedelta(hours=8))


def release_in(seconds: float, *, now: Optional[float] = None) -> str:
    """``now + seconds`` as the API writes it: whole seconds, ``+08:00`` offset.

    Rounded down, so the release is never further away than asked: a test that sets
    600 s can rely on ``remaining_seconds <= 600``.
    """
    base = datetime.now(timezone.utc).timestamp() if now is None else now
    when = datetime.fromtimestamp(math.floor(base + seconds), tz=_CST)
    return when.isoformat()


@dataclass
class Fault:
    """One injected fault. ``remaining`` None means until cleared; ``action`` None: every
    request the kind applies to, else only that OpenAPI action's (an account whose policy
    allows one action and not another)."""

    kind: str
    remaining: Optional[int] = None
    delay: float = 0.0
    action: Optional[str] = None

    def to_json(self) -> dict[str, Any]:
        shown = {"kind": self.kind, "remaining": self.remaining, "delay": self.delay}
        return shown if self.action is None else {**shown, "action": self.action}

    def applies_to(self, scope: str) -> bool:
        return self.action is None or self.action == scope


def _validate_fault(kind: str, count: Optional[int], delay: float,
                    action: Optional[str] = None) -> None:
    if action is not None and (not isinstance(action, str) or not action):
        raise ValueError(f"fault action must be an OpenAPI action name or null, got {action!r}")
    if kind not in FAULT_KINDS:
        raise ValueError(f"unknown fault kind {kind!r}; choose from {', '.join(FAULT_KINDS)}")
    if count is not None and (isinstance(count, bool) or not isinstance(count, int) or count < 1):
        raise ValueError(f"fault count must be a positive integer or null, got {count!r}")
    if (
        isinstance(delay, bool)
        or not isinstance(delay, (int, float))
        or not math.isfinite(delay)
        or delay < 0
    ):
        raise ValueError(f"fault delay must be a non-negative number of seconds, got {delay!r}")


class AccountLimit:
    """The account's API rate, shared by every host that calls it: a token bucket of
    ``per_second`` calls with bursts of ``burst``. ``allow()`` False is a throttled call.
    ``clock`` is injectable so the fleet simulation (benchmarks/bench_fleet.py) runs it on
    simulated time. Thread-safe."""

    def __init__(self, per_second: float, burst: Optional[float] = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not (math.isfinite(per_second) and per_second > 0):
            raise ValueError(f"per_second must be > 0, got {per_second!r}")
        self.per_second = float(per_second)
        self.burst = float(burst if burst is not None else max(1.0, per_second))
        if not (math.isfinite(self.burst) and self.burst >= 1):
            raise ValueError(f"burst must be >= 1, got {burst!r}")
        self._clock = clock
        self._tokens = self.burst
        self._updated = clock()
        self._lock = threading.Lock()
        self.allowed = 0
        self.throttled = 0

    def allow(self) -> bool:
        with self._lock:
            now = self._clock()
            self._tokens = min(self.burst, self._tokens + (now - self._updated) * self.per_second)
            self._updated = now
            if self._tokens >= 1:
                self._tokens -= 1
                self.allowed += 1
                return True
            self.throttled += 1
            return False


class EmulatorState:
    """The release time, the active faults and the request counters, under one lock."""

    def __init__(self, auto_release_at: Optional[str]) -> None:
        self._lock = threading.Lock()
        self._auto_release_at = auto_release_at
        self._faults: list[Fault] = []
        self._requests: Counter[str] = Counter()
        self._metadata_requests = 0
        self._events: list[dict[str, Any]] = []  # system events, in the wire format
        self._spot_termination_time: Optional[str] = None  # None: 404, no notice

    def set_release(self, auto_release_at: Optional[str]) -> None:
        if auto_release_at is not None and not isinstance(auto_release_at, str):
            raise ValueError(f"auto_release_at must be a string or null, got {auto_release_at!r}")
        with self._lock:
            self._auto_release_at = auto_release_at

    @property
    def auto_release_at(self) -> Optional[str]:
        with self._lock:
            return self._auto_release_at

    def set_spot_termination_time(self, text: Optional[str]) -> None:
        if text is not None and not isinstance(text, str):
            raise ValueError(f"termination_time must be a string or null, got {text!r}")
        with self._lock:
            self._spot_termination_time = text

    @property
    def spot_termination_time(self) -> Optional[str]:
        with self._lock:
            return self._spot_termination_time

    def add_event(self, event: dict[str, Any]) -> None:
        with self._lock:
            self._events.append(dict(event))

    def update_event(self, event_id: str, **fields: Any) -> None:
        with self._lock:
            for event in self._events:
                if event["Id"] == event_id:
                    event.update(fields)
                    return
        raise ValueError(f"no system event {event_id!r}")

    def clear_events(self) -> None:
        with self._lock:
            self._events.clear()

    @property
    def events(self) -> list[dict[str, Any]]:
        with self._lock:
            return [dict(event) for event in self._events]

    def add_fault(self, kind: str, count: Optional[int] = None, delay: float = 0.0,
                  action: Optional[str] = None) -> None:
        _validate_fault(kind, count, delay, action)
        with self._lock:
            self._faults.append(Fault(kind, count, float(delay), action))

    def clear_faults(self) -> None:
        with self._lock:
            self._faults.clear()

    def count_api(self, action: str) -> None:
        with self._lock:
            self._requests[action] += 1

    def count_metadata(self) -> None:
        with self._lock:
            self._metadata_requests += 1

    def request_count(self, action: Optional[str] = None) -> int:
        with self._lock:
            if action is None:
                return sum(self._requests.values())
            return self._requests[action]

    def metadata_request_count(self) -> int:
        with self._lock:
            return self._metadata_requests

    def take_faults(self, scope: str) -> list[Fault]:
        """The faults that shape one request, each using up one of its ``count``.

        ``scope`` is an OpenAPI action name, ``"metadata"`` or ``"spot"``. For an API
        request the first active error fault wins; change-the-answer faults are then not used up,
        since the answer they would change is never sent. ``slow`` applies either way.
        """
        is_api = scope not in ("metadata", "spot")
        with self._lock:
            chosen: list[Fault] = []
            error = next((f for f in self._faults if is_api and f.kind in ERROR_FAULTS
                          and f.applies_to(scope)), None)
            for fault in self._faults:
                applies = _MODIFIER_SCOPE.get(fault.kind)
                if fault is error or (
                    applies is not None
                    and fault.applies_to(scope)
                    and (applies == scope or (applies == "api" and is_api))
                    and (error is None or fault.kind == "slow")
                ):
                    chosen.append(Fault(fault.kind, fault.remaining, fault.delay, fault.action))
                    if fault.remaining is not None:
                        fault.remaining -= 1
            self._faults = [f for f in self._faults if f.remaining is None or f.remaining > 0]
            return chosen

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "auto_release_at": self._auto_release_at,
                "system_events": [dict(event) for event in self._events],
                "spot_termination_time": self._spot_termination_time,
                "faults": [fault.to_json() for fault in self._faults],
                "request_counts": dict(self._requests),
                "metadata_requests": self._metadata_requests,
            }
