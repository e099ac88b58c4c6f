"""The protection verdict's rule (sidecar.train.protection): pure, no clock."""

from __future__ import annotations

import math

import pytest

from sidecar.train.protection import (
    DurableCheckpoint,
    JobFigures,
    judge,
    judge_one,
    parse_notice,
    short_duration,
)

NOW = 1_900_000_000.0


def test_a_notice_shorter_than_save_and_upload_is_not_protected_and_says_what_is_lost() -> None:
    job = JobFigures(step_seconds=5.0, save_seconds=60.0, upload_seconds=30.0)
    durable = DurableCheckpoint(step=1200, at_unix=NOW - 41 * 60)
    verdict = judge_one("gcp", 30.0, job, durable, NOW)
    assert verdict.protected is False and verdict.status == "not-protected"
    assert verdict.needed_seconds == 95.0
    assert verdict.at_risk_seconds == 41 * 60 and verdict.at_risk_step == 1200
    assert verdict.reason == ("gcp: 30 s notice < 95 s step + save + upload: a reclaim now "
                              "loses the 41 min since step 1200")


def test_a_notice_that_holds_them_is_protected() -> None:
    verdict = judge_one("aws", 120.0, JobFigures(5.0, 60.0, None), None, NOW)
    assert verdict.protected is True
    assert verdict.reason == "aws: 120 s notice >= 65 s step + save"


def test_equal_is_enough() -> None:
    assert judge_one("azure", 30.0, JobFigures(0.0, 30.0), None, NOW).protected is True


def test_a_time_known_ahead_is_protected_whatever_the_save_takes() -> None:
    verdict = judge_one("volcengine-esi", None, JobFigures(5.0, 3600.0, 3600.0), None, NOW)
    assert verdict.protected is True and verdict.notice_seconds is None
    assert "known far ahead" in verdict.reason


def test_without_the_jobs_save_time_the_verdict_is_unknown() -> None:
    verdict = judge_one("gcp", 30.0, JobFigures(step_seconds=2.0), None, NOW)
    assert verdict.protected is None and verdict.status == "unknown"
    assert verdict.to_json()["status"] == "unknown"


def test_no_durable_checkpoint_loses_everything() -> None:
    verdict = judge_one("gcp", 30.0, JobFigures(1.0, 60.0), None, NOW)
    assert verdict.at_risk_seconds is None
    assert verdict.reason.endswith("loses everything since the job started (no durable "
                                   "checkpoint)")


def test_judge_keeps_the_order_given() -> None:
    verdicts = judge({"gcp": 30.0, "volcengine-esi": None, "aws": 120.0},
                     JobFigures(1.0, 60.0), None, NOW)
    assert [v.source for v in verdicts] == ["gcp", "volcengine-esi", "aws"]
    assert [v.protected for v in verdicts] == [False, True, True]


@pytest.mark.parametrize(("text", "seconds"), [("30", 30.0), ("15s", 15.0), ("2m", 120.0),
                                               ("5min", 300.0), (" ahead ", None)])
def test_notices_parse(text: str, seconds: float) -> None:
    assert parse_notice(text) == seconds


@pytest.mark.parametrize("text", ["", "abc", "0", "-5", "nan", "inf", "1e9", "min"])
def test_nonsense_notices_are_refused(text: str) -> None:
    with pytest.raises(ValueError):
        parse_notice(text)


def test_short_durations() -> None:
    assert short_duration(95) == "95 s"
    assert short_duration(300) == "300 s"
    assert short_duration(41 * 60) == "41 min"
    assert short_duration(3 * 3600) == "3.0 h"
    assert not math.isnan(float(short_duration(0).split()[0]))
