"""A log that one repeated error cannot flood.

When accept() fails for want of descriptors, asyncio logs the failure with a traceback
once per connection in the backlog, every time it retries: 48 MB in 20 s (issue:
file-descriptor exhaustion). ``RepeatFilter`` lets the first of identical warnings and
errors through, then one per interval that says how many were held back.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional

__all__ = ["REPEAT_INTERVAL_SECONDS", "RepeatFilter", "hold_back_repeats"]

REPEAT_INTERVAL_SECONDS = 60.0
# Distinct messages remembered; the oldest is forgotten first (memory stays bounded).
REMEMBERED = 256


class RepeatFilter(logging.Filter):
    """Passes a WARNING-or-worse record unless the same one (logger, level, message and
    exception type) passed less than ``interval`` ago; the next one to pass carries the
    count held back. Lower levels always pass."""

    def __init__(self, interval: float = REPEAT_INTERVAL_SECONDS, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self._interval = interval
        self._clock = clock
        self._seen: dict[tuple[str, int, str, str], tuple[float, int]] = {}  # shown at, held
        self._lock = threading.Lock()  # the poll and upload threads log too

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        message = record.getMessage()
        exception = type(record.exc_info[1]).__name__ if record.exc_info else ""
        key = (record.name, record.levelno, message, exception)
        now = self._clock()
        with self._lock:
            seen = self._seen.pop(key, None)
            if seen is not None and now - seen[0] < self._interval:
                self._seen[key] = (seen[0], seen[1] + 1)
                return False
            self._seen[key] = (now, 0)
            while len(self._seen) > REMEMBERED:
                del self._seen[next(iter(self._seen))]
        if seen is not None and seen[1]:
            record.msg = "%s (%d more like it in the last %.0f s)"
            record.args = (message, seen[1], now - seen[0])
        return True


def hold_back_repeats(logger: Optional[logging.Logger] = None) -> None:
    """Give each handler of ``logger`` (default: the root logger) its own RepeatFilter."""
    for handler in (logger or logging.getLogger()).handlers:
        if not any(isinstance(found, RepeatFilter) for found in handler.filters):
            handler.addFilter(RepeatFilter())
