"""What Slurm's client commands print, read the same on both sides: run under ``TZ=UTC``,
a job's row in a fixed ``squeue`` format, end times, the states of a job that runs.

A job's end is read from ``squeue -h -t all -j <id> -o '%i|%T|%e|%l|%P'`` (:func:`job_query`):
the id, state, end time, time limit and partition, and no field the job writes. Never from
``scontrol show job -o``: it prints the job's name (and comment, work dir...) as free text
among its ``Name=value`` words, so a job named ``x EndTime=2099-12-31T00:00:00`` forges the
first ``EndTime``. ``squeue --json`` is no better here: Slurm 22.05 (Debian 12) ignores
every filter with it and dumps all jobs of the cluster, and its schema changed in 23.02 and
24.05; the fixed format reads the same on every version. :func:`parse_job_rows` refuses a
line that does not have exactly the five fields.

Slurm prints local times without an offset, in the zone of the process that runs the
client command: :func:`run_command` runs it with ``TZ=UTC`` and
``SLURM_TIME_FORMAT=standard``, so :func:`parse_end_time` reads its times as UTC with
nothing guessed. Standard library only: the daemon's slurm source and the training side's
``SlurmDeadline`` share it.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Optional

__all__ = ["JOB_FORMAT", "NO_END", "RUNNING_STATES", "JobRow", "job_query", "node_query",
           "parse_end_time", "parse_job_rows", "parse_record", "run_command"]

RUNNING_STATES = ("RUNNING", "SUSPENDED", "COMPLETING", "STOPPED")
NO_END = ("Unknown", "None", "N/A", "UNLIMITED", "INFINITE", "NONE")
#: Job id, state, end time, time limit, partition: none of them set by the job as text.
JOB_FORMAT = "%i|%T|%e|%l|%P"


@dataclass(frozen=True)
class JobRow:
    """One job as ``squeue -o JOB_FORMAT`` prints it (the end time still as text)."""

    job_id: str
    state: str
    end: str
    time_limit: str
    partition: str

    @property
    def running(self) -> bool:
        return self.state in RUNNING_STATES


def job_query(job_id: str) -> list[str]:
    """The command that prints job ``job_id`` (in any state: an ended job is a row too)."""
    return ["squeue", "-h", "-t", "all", "-j", job_id, "-o", JOB_FORMAT]


def node_query(node: str) -> list[str]:
    """The command that prints every running job on ``node``."""
    return ["squeue", "-h", "-w", node, "-t", ",".join(RUNNING_STATES), "-o", JOB_FORMAT]


def run_command(command: list[str], seconds: float) -> subprocess.CompletedProcess[str]:
    """One Slurm client command, its times in UTC, killed after ``seconds``."""
    env = {**os.environ, "TZ": "UTC", "SLURM_TIME_FORMAT": "standard"}
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=seconds,
                          check=False)


def parse_job_rows(text: str) -> list[JobRow]:
    """Every line of a ``JOB_FORMAT`` answer; ValueError for a line without exactly its
    five fields or without a job id."""
    rows = []
    for line in text.splitlines():
        if not line.strip():
            continue
        fields = line.strip().split("|")
        if len(fields) != 5 or not fields[0]:
            raise ValueError(f"unexpected squeue line {line.strip()[:60]!r}")
        rows.append(JobRow(*fields))
    return rows


def parse_record(text: str) -> dict[str, str]:
    """``Name=value`` words of one ``scontrol show -o`` line (the first of each name). Only
    for records no job writes (a partition's): a job's record carries its name as text."""
    fields: dict[str, str] = {}
    for word in text.split():
        name, sep, value = word.partition("=")
        if sep and name and name not in fields:
            fields[name] = value
    return fields


def parse_end_time(text: str) -> Optional[float]:
    """A Slurm time printed under ``TZ=UTC`` as Unix seconds; None for no end (a job
    without a time limit: ``Unknown``, ``UNLIMITED``...); ValueError for anything else."""
    text = text.strip()
    if text in NO_END:
        return None
    try:
        moment = datetime.strptime(text, "%Y-%m-%dT%H:%M:%S")
    except ValueError:
        raise ValueError(f"unexpected end time {text[:40]!r}") from None
    return moment.replace(tzinfo=timezone.utc).timestamp()
