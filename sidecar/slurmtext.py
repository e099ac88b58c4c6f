"""What Slurm's client commands print, read the same on both sides: run under ``TZ=UTC``,
their ``Name=value`` records and end times, the states of a job that runs.

Slurm prints local times without an offset, in the zone of the process that runs the
client command: :func:`run_command` runs it with ``TZ=UTC`` and
``SLURM_TIME_FORMAT=standard``, so :func:`parse_end_time` reads its times as UTC with
nothing guessed. Standard library only: the daemon's slurm source and the training side's
``SlurmDeadline`` share it.
"""

from __future__ import annotations

import os
import subprocess
from datetime import datetime, timezone
from typing import Optional

__all__ = ["NO_END", "RUNNING_STATES", "parse_end_time", "parse_record", "run_command"]

RUNNING_STATES = ("RUNNING", "SUSPENDED", "COMPLETING", "STOPPED")
NO_END = ("Unknown", "None", "N/A", "UNLIMITED", "INFINITE", "NONE")


def run_command(command: list[str], seconds: float) -> subprocess.CompletedProcess[str]:
    """One Slurm client command, its times in UTC, killed after ``seconds``."""
    env = {**os.environ, "TZ": "UTC", "SLURM_TIME_FORMAT": "standard"}
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=seconds,
                          check=False)


def parse_record(text: str) -> dict[str, str]:
    """``Name=value`` words of one ``scontrol show -o`` line (the first of each name)."""
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
