"""Property tests for sidecar.timeparse (hypothesis): every accepted form round-trips, every
accepted value is a plausible deadline, and nothing else is accepted, with TimestampError
and never another exception.

Bounded: a few hundred examples per property, no example database. Under CI (the ``CI``
variable) hypothesis loads its own ``ci`` profile: derandomized, so a run is repeatable.
"""

from __future__ import annotations

import email.utils
import math
import re
from datetime import datetime, timedelta, timezone, tzinfo
from typing import Any, Optional
from zoneinfo import ZoneInfo

import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from sidecar.timeparse import (
    EARLIEST,
    VOLCENGINE_TIMEZONE,
    ParsedTime,
    TimestampError,
    format_rfc3339,
    parse_http_date,
    parse_timestamp,
)

EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)
# The latest instant each form promises: Unix numbers stop below 1e11 s (1e14 ms), the year
# 5138; a written date-time at the end of the year 9999.
LATEST_UNIX = EPOCH + timedelta(seconds=1e11)
LATEST = datetime.max.replace(tzinfo=timezone.utc)
MILLIS_FROM = 1e11  # the magnitude from which a number is read as milliseconds

SOME = settings(max_examples=300, deadline=None, database=None)
FEW = settings(max_examples=100, deadline=None, database=None)


def check_plausible(parsed: ParsedTime, *, latest: datetime = LATEST) -> None:
    """What every accepted value promises: an aware UTC instant from 2000 on, finite."""
    assert isinstance(parsed, ParsedTime)
    assert parsed.when.tzinfo is timezone.utc
    assert EARLIEST <= parsed.when <= latest
    assert math.isfinite(parsed.unix)


def parse_or_error(value: Any, **kwargs: Any) -> Optional[ParsedTime]:
    """The parsed time, or None for a TimestampError that names the value; any other
    exception escapes and fails the property."""
    try:
        return parse_timestamp(value, **kwargs)
    except TimestampError as exc:
        assert str(exc)
        return None


# ------------------------------------------------------------------ strategies

offsets = st.integers(-(23 * 60 + 59), 23 * 60 + 59).map(
    lambda minutes: timezone(timedelta(minutes=minutes)))
# Local times from 2000-01-02 to 9999-12-30: in UTC they stay within 2000 .. 9999 whatever
# the offset, and the far ends (the years 2000 and 9999) are drawn often.
aware_datetimes = st.datetimes(
    min_value=datetime(2000, 1, 2), max_value=datetime(9999, 12, 30, 23, 59, 59, 999999),
    timezones=offsets,
)
# For the texts that must be refused too: before 2000, and the very end of the year 9999
# (in the year 10000 once in UTC).
any_year_datetimes = st.datetimes(
    min_value=datetime(1990, 1, 1), timezones=offsets,
)
padding = st.text(alphabet=" \t\n", max_size=2)


def zone_text(offset: timedelta, draw: Any) -> str:
    total = int(offset.total_seconds() // 60)
    if total == 0:
        return str(draw(st.sampled_from(["Z", "z", "UTC", "GMT", "+00:00", "-00:00", "+0000",
                                         "+00"])))
    sign = "-" if total < 0 else "+"
    hours, minutes = divmod(abs(total), 60)
    forms = [f"{sign}{hours:02d}:{minutes:02d}", f"{sign}{hours:02d}{minutes:02d}"]
    if minutes == 0:
        forms.append(f"{sign}{hours:02d}")
    return str(draw(st.sampled_from(forms)))


@st.composite
def written_datetimes(draw: Any, zoned: bool = True,
                      datetimes: st.SearchStrategy[datetime] = aware_datetimes,
                      ) -> tuple[str, datetime]:
    """An RFC 3339 / ISO 8601 text in one of the accepted variants, and the instant it
    writes (to its precision: no seconds, or a fraction cut to microseconds)."""
    when = draw(datetimes)
    text = f"{when:%Y-%m-%d}{draw(st.sampled_from('Tt '))}{when:%H:%M}"
    if draw(st.booleans()):
        text += f":{when:%S}"
        digits = draw(st.integers(0, 9))
        if digits:
            written = f"{when.microsecond:06d}"[:digits]
            written += draw(st.text(alphabet="0123456789", min_size=max(0, digits - 6),
                                    max_size=max(0, digits - 6)))
            text += draw(st.sampled_from(".,")) + written
            when = when.replace(microsecond=int(written[:6].ljust(6, "0")))
        else:
            when = when.replace(microsecond=0)
    else:
        when = when.replace(second=0, microsecond=0)
    if zoned:
        offset = when.utcoffset()
        assert offset is not None
        text += draw(st.sampled_from(["", " "])) + zone_text(offset, draw)
    return draw(padding) + text + draw(padding), when


unix_seconds = st.floats(min_value=EARLIEST.timestamp(), max_value=MILLIS_FROM,
                         exclude_max=True)
unix_millis = st.integers(min_value=int(EARLIEST.timestamp()) * 1000,
                          max_value=10**14 - 1)


# ------------------------------------------------------------------ round trips


@SOME
@given(aware_datetimes)
def test_format_then_parse_is_the_same_instant(when: datetime) -> None:
    parsed = parse_timestamp(format_rfc3339(when))
    assert parsed.when == when  # to the microsecond: the form keeps them all
    assert parsed.assumed_timezone is None
    check_plausible(parsed)
    assert format_rfc3339(parsed.when) == format_rfc3339(when)


@SOME
@given(written_datetimes())
def test_every_written_variant_parses_to_its_instant(case: tuple[str, datetime]) -> None:
    text, when = case
    parsed = parse_timestamp(text)
    assert parsed.when == when, text
    assert parsed.assumed_timezone is None
    check_plausible(parsed)


naive_zones = st.one_of(
    offsets,
    st.sampled_from([timezone.utc, VOLCENGINE_TIMEZONE, ZoneInfo("Asia/Shanghai"),
                     ZoneInfo("America/New_York"), ZoneInfo("Europe/London")]),
)


@SOME
@given(written_datetimes(zoned=False), naive_zones)
def test_a_naive_time_is_read_in_the_zone_given_and_says_so(
    case: tuple[str, datetime], zone: tzinfo
) -> None:
    text, written = case
    local = written.replace(tzinfo=None)  # the wall-clock time as written
    expected = local.replace(tzinfo=zone).astimezone(timezone.utc)
    assume(expected >= EARLIEST)
    parsed = parse_timestamp(text, naive_timezone=zone)
    assert parsed.when == expected, text
    assert parsed.assumed_timezone == (getattr(zone, "key", None) or zone.tzname(None))
    check_plausible(parsed)


@SOME
@given(st.integers(min_value=int(EARLIEST.timestamp()), max_value=int(MILLIS_FROM) - 1),
       st.sampled_from(["{}", "+{}", "{}.", "{}.0", " {} "]))
def test_whole_unix_seconds_as_number_and_text(seconds: int, form: str) -> None:
    expected = EPOCH + timedelta(seconds=seconds)
    for value in (seconds, float(seconds), form.format(seconds)):
        parsed = parse_timestamp(value)
        assert parsed.when == expected, value
        check_plausible(parsed, latest=LATEST_UNIX)


@SOME
@given(unix_seconds, st.sampled_from(["{!r}", "{:.17e}", "{:.17E}"]))
def test_fractional_unix_seconds_to_the_microsecond(seconds: float, form: str) -> None:
    for value in (seconds, form.format(seconds)):
        parsed = parse_timestamp(value)
        # The datetime holds microseconds: the nearest one, read back as a float.
        assert abs(parsed.unix - seconds) <= 0.5e-6 + 2 * math.ulp(seconds), value
        check_plausible(parsed, latest=LATEST_UNIX)


@SOME
@given(unix_millis)
def test_unix_milliseconds_to_the_millisecond(millis: int) -> None:
    for value in (millis, str(millis), f"{float(millis):.17e}"):
        parsed = parse_timestamp(value)
        assert round((parsed.when - EPOCH) / timedelta(milliseconds=1)) == millis, value
        check_plausible(parsed, latest=LATEST_UNIX)


@SOME
@given(aware_datetimes, st.booleans())
def test_http_dates_round_trip_to_the_second(when: datetime, gmt: bool) -> None:
    if gmt:
        when = when.astimezone(timezone.utc)
    text = email.utils.format_datetime(when, usegmt=gmt)
    parsed = parse_http_date(text)
    assert parsed.when == when.replace(microsecond=0), text
    check_plausible(parsed)


# ------------------------------------------------------------------ nothing else

# An independent reading of the grammar (ASCII only), for the differential property below.
_REFERENCE_ISO = re.compile(
    r"(\d{4})-(\d{2})-(\d{2})[Tt\s](\d{2}):(\d{2})(?::(\d{2})(?:[.,](\d+))?)?"
    r"\s*(Z|z|UTC|GMT|([+-])(\d{2})(?::?(\d{2}))?)?", re.ASCII)
_REFERENCE_NUMBER = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?", re.ASCII)


def reference(text: str) -> Optional[datetime]:
    """What ``text`` means by the module's documented rules (naive read as UTC), else None."""
    stripped = text.strip()
    if _REFERENCE_NUMBER.fullmatch(stripped):
        number = float(stripped)
        if not math.isfinite(number) or number < EARLIEST.timestamp() or number >= 1e14:
            return None
        when = EPOCH + timedelta(seconds=number / 1000 if number >= MILLIS_FROM else number)
        return when if when >= EARLIEST else None
    match = _REFERENCE_ISO.fullmatch(stripped)
    if match is None:
        return None
    year, month, day, hour, minute, second, fraction, _zone, sign, zh, zm = match.groups()
    offset = timedelta(0)
    if sign is not None:
        if int(zh) > 23 or int(zm or 0) > 59:
            return None
        offset = (-1 if sign == "-" else 1) * timedelta(hours=int(zh), minutes=int(zm or 0))
    try:
        local = datetime(int(year), int(month), int(day), int(hour), int(minute),
                         int(second or 0), int((fraction or "0")[:6].ljust(6, "0")))
        when = local.replace(tzinfo=timezone(offset)).astimezone(timezone.utc)
    except (ValueError, OverflowError):
        return None
    return when if when >= EARLIEST else None


# Characters the grammar is made of, so that random strings come near it often.
_GRAMMAR_ALPHABET = "0123456789-:.,+_eETtZzUCGM \t"


@st.composite
def near_grammar(draw: Any) -> str:
    """Strings close to the accepted forms: random ones from the grammar's characters,
    and valid texts with a few characters replaced, dropped or added."""
    if draw(st.booleans()):
        return str(draw(st.text(alphabet=_GRAMMAR_ALPHABET, max_size=32)))
    text, _when = draw(written_datetimes(datetimes=any_year_datetimes))
    if draw(st.booleans()):
        text = str(draw(st.sampled_from(["{}", "{}000"]))).format(
            draw(st.integers(0, 10**15)))
    chars = list(text)
    for _ in range(draw(st.integers(0, 3))):
        where = draw(st.integers(0, len(chars)))
        action = draw(st.sampled_from(["replace", "drop", "insert"]))
        char = draw(st.sampled_from(_GRAMMAR_ALPHABET + "xO/"))
        if action == "insert" or where == len(chars):
            chars.insert(where, char)
        elif action == "drop":
            del chars[where]
        else:
            chars[where] = char
    return "".join(chars)


@settings(max_examples=600, deadline=None, database=None)
@given(near_grammar())
@example("2026-13-01T00:00:00Z")  # month 13
@example("2026-02-01T24:00:00Z")  # hour 24
@example("2026-02-01T23:59:60Z")  # a leap second
@example("2026-02-29T00:00:00Z")  # not a leap year
@example("2026-02-01T04:00:00+24:00")
@example("2026-02-01T04:00:00+08:60")
@example("2026-02-01T04:00:00+8")
@example("2026-02-01T04:00.5Z")  # a fraction needs seconds
@example("1999-12-31T23:59:59Z")
@example("9999-12-31T23:59:59-01:00")  # the year 10000 in UTC
@example("1_769_918_400")
@example("0x1f")
@example("nan")
@example("1e400")
@example("1e14")
@example("946684799")
def test_accepted_exactly_when_the_text_is_a_time(text: str) -> None:
    parsed = parse_or_error(text)
    expected = reference(text)
    assert (parsed.when if parsed else None) == expected, text
    if parsed is not None:
        check_plausible(parsed)


@FEW
@given(st.one_of(
    st.text(max_size=40),
    st.binary(max_size=40).map(lambda raw: raw.decode("utf-8", errors="replace")),
    st.binary(max_size=40).map(lambda raw: raw.decode("latin-1")),
))
@example("")
@example("   \t\n")
@example("nan")
@example("-inf")
@example("Infinity")
@example("0x1f")
@example("1_769_918_400")
@example("tomorrow")
@example("2026-02-01T04:00:00Z\x00")
def test_any_text_is_a_plausible_time_or_a_timestamp_error(text: str) -> None:
    parsed = parse_or_error(text)
    if parsed is not None:
        check_plausible(parsed)


@FEW
@given(st.one_of(
    st.integers(),
    st.floats(),
    st.none(),
    st.booleans(),
    st.binary(max_size=20),
    st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    st.decimals(allow_nan=False, allow_infinity=False),
    st.complex_numbers(),
))
@example(float("nan"))
@example(float("inf"))
@example(-1)
@example(0)
@example(10**14)
@example(True)
def test_any_value_is_a_plausible_time_or_a_timestamp_error(value: Any) -> None:
    parsed = parse_or_error(value)
    if parsed is not None:
        assert isinstance(value, (int, float)) and not isinstance(value, bool)
        assert EARLIEST.timestamp() <= value < 1e14
        check_plausible(parsed, latest=LATEST_UNIX)


http_parts = st.tuples(
    st.sampled_from(["", "Mon, ", "Tue, ", "Xyz, "]),
    st.integers(0, 40),
    st.sampled_from(["Jan", "Feb", "Dec", "Foo"]),
    st.integers(1899, 10001),
    st.integers(0, 25), st.integers(0, 61), st.integers(0, 61),
    st.sampled_from(["GMT", "UTC", "+0000", "-0000", "+0800", "-2359", "+2400", "-0100", "EST",
                     "", "+99"]),
)


@FEW
@given(st.one_of(http_parts.map(lambda p: f"{p[0]}{p[1]} {p[2]} {p[3]} "
                                          f"{p[4]:02d}:{p[5]:02d}:{p[6]:02d} {p[7]}"),
                 st.text(max_size=40)))
@example("")
@example("Tuesday")
def test_any_http_date_text_is_a_plausible_time_or_a_timestamp_error(text: str) -> None:
    try:
        parsed = parse_http_date(text)
    except TimestampError:
        return
    check_plausible(parsed)


@FEW
@given(aware_datetimes)
def test_an_http_date_whose_zone_is_unknown_is_refused(when: datetime) -> None:
    # RFC 2822: "-0000" says the time is UTC-based but the local zone is unknown.
    text = email.utils.format_datetime(when)[:-5] + "-0000"
    with pytest.raises(TimestampError, match="no time zone"):
        parse_http_date(text)


# ------------------------------------------------------------------ defects found here
# Each failed on the code before its fix (found by the properties above).


@pytest.mark.parametrize("value", [100_000_000_000, "500000000000", "946684799999",
                                   "99999999999.9999999"])
def test_milliseconds_before_2000_are_not_a_deadline(value: Any) -> None:
    assert parse_or_error(value) is None


@pytest.mark.parametrize("digits", [400, 5000])  # 5000: beyond what repr() writes (4300)
def test_an_integer_too_large_for_a_float_is_a_timestamp_error(digits: int) -> None:
    assert parse_or_error(10**digits) is None


def test_an_http_date_beyond_the_year_9999_is_a_timestamp_error() -> None:
    with pytest.raises(TimestampError):
        parse_http_date("31 Dec 9999 23:59:59 -0100")
