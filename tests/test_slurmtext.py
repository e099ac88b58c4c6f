"""What Slurm prints, read the same on both sides (sidecar/slurmtext.py): end times as UTC
whatever this process's zone, and a job's row in a format no job field can forge.

The expected instants are literals worked out by hand, never computed with the parser:
2024-03-10T12:34:56 UTC is 19792 days after 1970-01-01 (54 years with 13 leap days to
2024-01-01 = 19723 days, plus 31 + 29 + 9) = 1710028800 s, plus 12:34:56 = 45296 s.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator

import pytest

from sidecar.host.sources.slurm import SlurmSource
from sidecar.slurmtext import (
    JOB_FORMAT,
    job_query,
    node_query,
    parse_end_time,
    parse_job_rows,
    parse_record,
)
from sidecar.train.slurm_deadline import SlurmDeadline

TEXT = "2024-03-10T12:34:56"
EPOCH = 1710074096  # by hand, see the module's docstring

# What Slurm 22.05 printed for `sbatch --time=3 --job-name='train EndTime=2099-12-31T00:00:00'`
# (the real cluster of tests/support/slurm_cluster.py; the fields after Partition cut).
FORGED_RECORD = (
    "JobId=1 JobName=train EndTime=2099-12-31T00:00:00 UserId=root(0) GroupId=root(0) "
    "JobState=RUNNING Reason=None TimeLimit=00:03:00 StartTime=2026-12-03T18:34:00 "
    "EndTime=2026-12-03T18:37:00 Deadline=N/A Partition=debug\n")
REAL_ROW = "1|RUNNING|2026-12-03T18:37:00|3:00|debug\n"
REAL_END = 1796323020  # 2026-12-03T18:37:00 UTC, as `squeue --json` printed its end_time
FORGED_END = 4102358400  # 2099-12-31T00:00:00 UTC


@pytest.fixture(params=["America/Los_Angeles", "UTC", "Asia/Kolkata"])
def zone(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """This process in a zone west of UTC, UTC itself, and east of it."""
    monkeypatch.setenv("TZ", request.param)
    time.tzset()
    yield request.param
    monkeypatch.undo()
    time.tzset()


def test_an_end_time_is_read_as_utc_in_any_local_zone(zone: str) -> None:
    offset = time.localtime(EPOCH).tm_gmtoff
    assert (offset < 0, offset == 0, offset > 0) == (
        zone == "America/Los_Angeles", zone == "UTC", zone == "Asia/Kolkata")
    assert parse_end_time(TEXT) == EPOCH
    assert parse_end_time(" 2026-12-03T18:37:00\n") == REAL_END


@pytest.mark.parametrize("text", ["Unknown", "UNLIMITED", "N/A", "NONE"])
def test_no_end_is_none(text: str) -> None:
    assert parse_end_time(text) is None


@pytest.mark.parametrize("text", ["tomorrow", "2024-03-10 12:34:56", "2024-03-10T12:34:56Z",
                                  ""])
def test_anything_else_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="unexpected end time"):
        parse_end_time(text)


def test_a_job_record_is_forgeable_so_it_is_never_read() -> None:
    # Why: the name's words come first, and the first EndTime wins.
    assert parse_end_time(parse_record(FORGED_RECORD)["EndTime"]) == FORGED_END
    for command in (job_query("1"), node_query("gpu3")):
        assert command[0] == "squeue" and command[-2:] == ["-o", JOB_FORMAT]
    # Only the id, state, end, limit and partition: nothing the job writes as text.
    assert JOB_FORMAT.split("|") == ["%i", "%T", "%e", "%l", "%P"]


def test_a_row_has_exactly_five_fields() -> None:
    [row] = parse_job_rows(REAL_ROW)
    assert (row.job_id, row.state, row.end, row.time_limit, row.partition) == (
        "1", "RUNNING", "2026-12-03T18:37:00", "3:00", "debug")
    assert row.running and parse_job_rows("\n") == []
    for line in ["1|RUNNING|2099-12-31T00:00:00|3:00|debug|x", "1|RUNNING|3:00|debug",
                 "JobId=1 EndTime=2099-12-31T00:00:00", "|RUNNING|x|3:00|debug"]:
        with pytest.raises(ValueError, match="unexpected squeue line"):
            parse_job_rows(line)


def test_a_blank_line_between_rows_is_skipped_not_the_end_of_the_answer() -> None:
    rows = parse_job_rows(REAL_ROW + "\n" + "2|PENDING|Unknown|10:00|debug\n")
    assert [(row.job_id, row.running) for row in rows] == [("1", True), ("2", False)]


def test_a_partition_value_with_equals_signs_is_read_whole() -> None:
    # A partition record's TRES is `name=value` pairs: the first `=` ends the word's name.
    record = parse_record("PartitionName=debug TRES=cpu=2,mem=7940M,node=1 GraceTime=30\n")
    assert record == {"PartitionName": "debug", "TRES": "cpu=2,mem=7940M,node=1",
                      "GraceTime": "30"}


def recorded_slurm(command: list[str], seconds: float) -> subprocess.CompletedProcess[str]:
    """Slurm's answers for the job named to forge its end, as the real cluster gave them."""
    if command[:3] == ["scontrol", "show", "job"]:
        return subprocess.CompletedProcess(command, 0, FORGED_RECORD, "")
    if command[:3] == ["scontrol", "show", "partition"]:
        return subprocess.CompletedProcess(command, 0, "PartitionName=debug GraceTime=0\n", "")
    if command[0] == "squeue" and command[-1] == JOB_FORMAT:
        return subprocess.CompletedProcess(command, 0, REAL_ROW, "")
    return subprocess.CompletedProcess(command, 1, "", f"unexpected {command}")


def test_a_job_name_does_not_set_the_daemon_s_deadline() -> None:
    assert SlurmSource("1", run=recorded_slurm).poll().expires_at_unix == REAL_END
    assert SlurmSource(None, "vm", run=recorded_slurm).poll().expires_at_unix == REAL_END


def test_a_job_name_does_not_set_the_guard_s_deadline() -> None:
    slurm = SlurmDeadline("1", run=recorded_slurm)
    slurm.ask()
    assert slurm.last_known == REAL_END
