"""A log that one repeated error cannot flood.

When accept() fails for want of descriptors, asyncio logs the failure with a traceback
once per connection in the backlog, every time it retries: 48 MB in 20 s (issue:
file-descriptor exhaustion). ``RepeatFilter`` lets the first of identical warnings and
errors through, then one per interval that says how many were held back.

A log line the job cannot forge: file and folder names come from the training job, and a
name with a newline would write lines of its own (issue 35). :func:`printable` escapes
control characters in one text; ``EscapeControls`` does it to every message a handler
writes (the traceback of ``log.exception`` is kept as it is).
"""

from __future__ import annotations

import logging
import re
import threading
import time
from typing import Callable, Optional

__all__ = ["REPEAT_INTERVAL_SECONDS", "EscapeControls", "RepeatFilter", "hold_back_repeats",
           "printable"]

REPEAT_INTERVAL_SECONDS = 60.0
# Distinct messages remembered; the oldest is forgotten first (memory stays bounded).
REMEMBERED = 256
# C0 and C1 control characters, DEL, and the Unicode line and paragraph separators.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def _escape(found: re.Match[str]) -> str:
    char = found.group()
    named = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}.get(char)
    if named is not None:
        return named
    return f"\\x{ord(char):02x}" if ord(char) < 0x100 else f"\\u{ord(char):04x}"


def printable(text: str) -> str:
    """``text`` with every control character written as an escape (``\\n``, ``\\x1b``):
    one line, whatever a job named its files."""
    return _CONTROL.sub(_escape, text)


class EscapeControls(logging.Filter):
    """Writes each record's message with its control characters escaped (``printable``),
    so no argument can start a line of its own. Always passes the record."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        escaped = printable(message)
        if escaped != message:
            record.msg, record.args = escaped, None
        return True


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
    """Give each handler of ``logger`` (default: the root logger) its own RepeatFilter,
    after an ``EscapeControls`` (one line per record, whatever a job named its files)."""
    for handler in (logger or logging.getLogger()).handlers:
        if not any(isinstance(found, EscapeControls) for found in handler.filters):
            handler.addFilter(EscapeControls())
        if not any(isinstance(found, RepeatFilter) for found in handler.filters):
            handler.addFilter(RepeatFilter())
