"""Every timestamp format we accept -> an aware UTC datetime, or a clear error.

Standard library only: the training-side client shares this module.

Accepted:
- RFC 3339 / ISO 8601 date-times with ``Z``, ``UTC`` or an offset
  (``2026-02-01T12:00:00+08:00``, ``2026-02-01 04:00:00Z``, fractional seconds);
- Unix time as a number or a numeric string, in seconds or milliseconds, told apart
  by magnitude (AWS documents its capacity-block timestamp in seconds on one page and
  in milliseconds on another, so we must accept both);
- a naive date-time (no offset), read in a given time zone (default UTC); the result
  says which zone was assumed so callers can report it. Each source passes its platform's
  zone (``VOLCENGINE_TIMEZONE``, UTC for AWS and GCP) unless the daemon is told one;
- with :func:`parse_http_date`, RFC 1123 / RFC 2822 dates (``Mon, 19 Sep 2016 18:29:47
  GMT``, ``21 Jan 2019 09:00:43 GMT``), as AWS maintenance events and Azure Scheduled
  Events write them.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone, tzinfo
from typing import Optional, Union

__all__ = [
    "VOLCENGINE_TIMEZONE",
    "ParsedTime",
    "TimestampError",
    "format_rfc3339",
    "parse_http_date",
    "parse_timestamp",
    "parse_unix",
]

# Below this a number is Unix seconds (1e11 s is the year 5138); below MAX_MILLIS it is
# milliseconds (1e11 ms is 1973, 1e14 ms is the year 5138). Larger numbers (micro- or
# nanoseconds) are rejected rather than guessed.
_MILLIS_FROM = 1e11
_MAX_MILLIS = 1e14
# A deadline before 2000 is not a deadline: "12" or "1970-01-01T00:00:00Z" mean a field
# that was never set, and taking them literally would read as "released long ago".
EARLIEST = datetime(2000, 1, 1, tzinfo=timezone.utc)

_ISO = re.compile(
    r"""^\s*
    (?P<year>\d{4})-(?P<month>\d{2})-(?P<day>\d{2})
    [Tt\s]
    (?P<hour>\d{2}):(?P<minute>\d{2})
    (?::(?P<second>\d{2})(?:[.,](?P<fraction>\d+))?)?
    \s*(?P<zone>[Zz]|UTC|GMT|[+-]\d{2}(?::?\d{2})?)?
    \s*$""",
    re.VERBOSE,
)
# A time without an offset is read in the zone that makes it the earliest instant its
# platform could mean, so that a wrong guess saves early, never late (issue 13: read as UTC,
# a Beijing time came 8 h late). Volcengine writes +08:00 (Beijing time) in its OpenAPI
# answers and for its ML platform, and each of its regions lies at UTC+8 or west of it.
VOLCENGINE_TIMEZONE = timezone(timedelta(hours=8))  # named "UTC+08:00"

_NUMBER = re.compile(r"^\s*[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?\s*$")


class TimestampError(ValueError):
    """A value that is not a timestamp we understand. The message names the value."""


@dataclass(frozen=True)
class ParsedTime:
    """An aware UTC instant, and the zone assumed when the input had none."""

    when: datetime
    assumed_timezone: Optional[str] = None

    @property
    def unix(self) -> float:
        return self.when.timestamp()


def _describe(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def parse_unix(number: float, *, original: object = None) -> datetime:
    """Unix seconds or milliseconds (decided by magnitude) -> aware UTC datetime."""
    shown = _describe(number if original is None else original)
    if isinstance(number, bool) or not math.isfinite(number):
        raise TimestampError(f"not a timestamp: {shown}")
    if number <= 0:
        raise TimestampError(f"not a timestamp (zero or negative Unix time): {shown}")
    if number < EARLIEST.timestamp():
        raise TimestampError(f"not a plausible deadline: {shown} is before the year 2000")
    if number >= _MAX_MILLIS:
        raise TimestampError(
            f"not a timestamp: {shown} is too large for Unix seconds or milliseconds"
        )
    seconds = number / 1000.0 if number >= _MILLIS_FROM else float(number)
    if seconds < EARLIEST.timestamp():  # milliseconds of 1973-1999
        raise TimestampError(f"not a plausible deadline: {shown} is before the year 2000")
    return datetime(1970, 1, 1, tzinfo=timezone.utc) + timedelta(seconds=seconds)


def _zone_offset(zone: str) -> timezone:
    if zone in ("Z", "z", "UTC", "GMT"):
        return timezone.utc
    sign = -1 if zone[0] == "-" else 1
    digits = zone[1:].replace(":", "")
    hours = int(digits[:2])
    minutes = int(digits[2:4]) if len(digits) >= 4 else 0
    if hours > 23 or minutes > 59:
        raise ValueError("offset out of range")
    return timezone(sign * timedelta(hours=hours, minutes=minutes))


def _zone_name(zone: tzinfo) -> str:
    key = getattr(zone, "key", None)  # zoneinfo.ZoneInfo
    if isinstance(key, str):
        return key
    return str(zone.tzname(None) or zone)


def parse_timestamp(
    value: Union[str, int, float], *, naive_timezone: tzinfo = timezone.utc
) -> ParsedTime:
    """Parse one timestamp. Raises :class:`TimestampError` naming the value."""
    if isinstance(value, bool) or value is None:
        raise TimestampError(f"not a timestamp: {_describe(value)}")
    if isinstance(value, (int, float)):
        try:
            number = float(value)
        except OverflowError:  # an int from JSON with hundreds of digits
            raise TimestampError("not a timestamp: an integer too large for Unix seconds or "
                                 "milliseconds") from None
        return ParsedTime(parse_unix(number, original=value).astimezone(timezone.utc))
    if not isinstance(value, str):
        raise TimestampError(f"not a timestamp: {_describe(value)}")
    if not value.strip():
        raise TimestampError("empty timestamp")
    if _NUMBER.match(value):
        return ParsedTime(parse_unix(float(value), original=value))
    match = _ISO.match(value)
    if match is None:
        raise TimestampError(
            f"not a timestamp: {_describe(value)} (expected RFC 3339 such as "
            "'2026-02-01T12:00:00+08:00', or Unix seconds / milliseconds)"
        )
    parts = match.groupdict()
    fraction = (parts["fraction"] or "0")[:6].ljust(6, "0")
    try:
        zone: Optional[tzinfo] = _zone_offset(parts["zone"]) if parts["zone"] else None
        local = datetime(
            int(parts["year"]),
            int(parts["month"]),
            int(parts["day"]),
            int(parts["hour"]),
            int(parts["minute"]),
            int(parts["second"] or 0),
            int(fraction),
        )
    except ValueError as exc:
        raise TimestampError(f"not a valid date-time: {_describe(value)} ({exc})") from None
    assumed = None
    if zone is None:
        zone, assumed = naive_timezone, _zone_name(naive_timezone)
    try:
        when = local.replace(tzinfo=zone).astimezone(timezone.utc)
    except OverflowError:  # 9999-12-31T23:59:59-01:00 is in the year 10000
        raise TimestampError(f"out of range: {_describe(value)}") from None
    if when < EARLIEST:
        shown = _describe(value)
        raise TimestampError(f"not a plausible deadline: {shown} is before the year 2000")
    return ParsedTime(when, assumed_timezone=assumed)


def format_rfc3339(when: Union[datetime, float]) -> str:
    """An aware datetime or Unix seconds -> ``2026-11-29T14:00:00Z`` (fraction if any)."""
    if not isinstance(when, datetime):
        return _format_unix(float(when))
    if when.tzinfo is None:
        raise ValueError("naive datetime: refusing to guess its time zone")
    return _format_utc(when.astimezone(timezone.utc))


@functools.lru_cache(maxsize=256)
def _format_unix(when: float) -> str:
    # Cached: the daemon formats the same few deadlines and poll times on every request.
    return _format_utc(datetime.fromtimestamp(when, tz=timezone.utc))


def _format_utc(when: datetime) -> str:
    text = when.strftime("%Y-%m-%dT%H:%M:%S")
    if when.microsecond:
        text += f".{when.microsecond:06d}".rstrip("0")
    return text + "Z"


def parse_http_date(value: str) -> ParsedTime:
    """An RFC 1123 / RFC 2822 date with its zone (GMT, UTC or an offset). Raises
    :class:`TimestampError` naming the value."""
    from email.utils import parsedate_to_datetime

    if not isinstance(value, str) or not value.strip():
        raise TimestampError(f"empty or not a date: {_describe(value)}")
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        raise TimestampError(f"not an RFC 1123 date: {_describe(value)}") from None
    if when.tzinfo is None:  # "-0000": the zone is unknown
        raise TimestampError(f"no time zone in {_describe(value)}")
    try:
        when = when.astimezone(timezone.utc)
    except OverflowError:  # 31 Dec 9999 23:59:59 -0100 is in the year 10000 in UTC
        raise TimestampError(f"out of range: {_describe(value)}") from None
    if when < EARLIEST:
        raise TimestampError(f"before 2000, not a deadline: {_describe(value)}")
    return ParsedTime(when)
