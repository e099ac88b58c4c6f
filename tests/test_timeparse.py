from __future__ import annotations

from datetime import datetime, timedelta, timezone
from zoneinfo import ZoneInfo

import pytest

from sidecar.timeparse import TimestampError, format_rfc3339, parse_http_date, parse_timestamp

NOON_UTC = datetime(2026, 2, 1, 4, 0, tzinfo=timezone.utc)  # 12:00 at +08:00


@pytest.mark.parametrize(
    "text",
    [
        "2026-02-01T12:00:00+08:00",
        "2026-02-01T12:00:00+0800",
        "2026-02-01T04:00:00Z",
        "2026-02-01T04:00:00z",
        "2026-02-01 04:00:00Z",
        "2026-02-01T04:00:00.000Z",
        "2026-02-01T04:00:00.000000000Z",  # nanoseconds, as Go services print them
        "2026-02-01T04:00Z",
        "2026-02-01T04:00:00 UTC",
        "2026-01-31T23:00:00-05:00",
        "  2026-02-01T04:00:00Z  ",
    ],
)
def test_rfc3339_and_iso8601_with_offsets(text: str) -> None:
    parsed = parse_timestamp(text)
    assert parsed.when == NOON_UTC
    assert parsed.when.tzinfo == timezone.utc
    assert parsed.assumed_timezone is None


@pytest.mark.parametrize(
    "value",
    [1769918400, 1769918400.0, "1769918400", 1769918400000, "1769918400000", "1.7699184e9"],
)
def test_unix_seconds_and_milliseconds_told_apart_by_magnitude(value: object) -> None:
    assert parse_timestamp(value).when == NOON_UTC  # type: ignore[arg-type]


def test_fractional_unix_seconds_kept() -> None:
    assert parse_timestamp("1769918400.25").unix == pytest.approx(1769918400.25)


def test_naive_timestamp_read_in_configured_zone_and_reported() -> None:
    parsed = parse_timestamp("2026-02-01 12:00:00", naive_timezone=ZoneInfo("Asia/Shanghai"))
    assert parsed.when == NOON_UTC
    assert parsed.assumed_timezone == "Asia/Shanghai"
    default = parse_timestamp("2026-02-01T04:00:00")
    assert default.when == NOON_UTC
    assert default.assumed_timezone == "UTC"


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        ("", "empty"),
        ("   ", "empty"),
        ("tomorrow", "'tomorrow'"),
        ("2026-13-01T00:00:00Z", "'2026-13-01T00:00:00Z'"),
        ("2026-02-30T00:00:00Z", "2026-02-30"),
        ("2026-02-01T25:00:00Z", "2026-02-01T25"),
        ("2026-02-01T04:00:00+25:00", "+25:00"),
        ("0", "zero or negative"),
        (-5, "zero or negative"),
        (1e17, "too large"),  # nanoseconds: refuse to guess
        (float("nan"), "nan"),
        (float("inf"), "inf"),
        (True, "True"),
        (None, "None"),
        ("12:00", "'12:00'"),
        ("12", "before the year 2000"),
        (946684799, "before the year 2000"),
        ("1970-01-01T00:00:00Z", "before the year 2000"),
        # In the year 10000 once in UTC: was an OverflowError (a traceback from serve).
        ("9999-12-31T23:59:59-01:00", "out of range: '9999-12-31T23:59:59-01:00'"),
    ],
)
def test_bad_values_raise_an_error_naming_the_value(value: object, fragment: str) -> None:
    with pytest.raises(TimestampError) as info:
        parse_timestamp(value)  # type: ignore[arg-type]
    assert fragment in str(info.value)


def test_format_rfc3339_round_trips() -> None:
    assert format_rfc3339(NOON_UTC) == "2026-02-01T04:00:00Z"
    assert format_rfc3339(NOON_UTC.timestamp() + 0.5) == "2026-02-01T04:00:00.5Z"
    shifted = NOON_UTC.astimezone(timezone(timedelta(hours=8)))
    assert format_rfc3339(shifted) == "2026-02-01T04:00:00Z"
    assert parse_timestamp(format_rfc3339(NOON_UTC)).when == NOON_UTC
    with pytest.raises(ValueError, match="naive"):
        format_rfc3339(datetime(2026, 2, 1))


@pytest.mark.parametrize(
    ("value", "fragment"),
    [("", "empty"), ("Tuesday", "'Tuesday'"), ("21 Jan 2019 09:00:43 -0000", "no time zone"),
     ("01 Jan 1990 00:00:00 GMT", "before 2000")],
)
def test_http_dates_refuse_what_they_cannot_place(value: str, fragment: str) -> None:
    with pytest.raises(TimestampError, match=fragment):
        parse_http_date(value)


def test_http_dates_as_aws_and_azure_write_them() -> None:
    expected = 1548061243.0  # 2019-01-21T09:00:43Z
    assert parse_http_date("21 Jan 2019 09:00:43 GMT").unix == expected
    assert parse_http_date("Mon, 21 Jan 2019 09:00:43 GMT").unix == expected
    assert parse_http_date("Mon, 21 Jan 2019 17:00:43 +0800").unix == expected
