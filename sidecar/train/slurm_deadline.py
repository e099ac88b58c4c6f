"""A Slurm job's end time for the guard when no daemon answers: asked of slurmctld by one
rank, at most once a minute, in a background thread.

Standard library only. Inside a Slurm job (``SLURM_JOB_ID`` set) the guard asks
``squeue -h -t all -j $SLURM_JOB_ID`` itself, in a fixed format with no field the job can
write (``sidecar.slurmtext.JOB_FORMAT``: a job's name cannot forge its end as it can in
``scontrol show job -o``), while no daemon answers; with a reducer only
rank 0 (``$RANK``, else ``$SLURM_PROCID``) asks, and the other ranks learn the end through
the vote (the remaining time is combined with MIN), so a job of 512 ranks costs
slurmctld one call a minute, not 512 a second. The call runs in a thread and is killed
after ``COMMAND_SECONDS``: a slurmctld that is down or slow never holds a training step.
A failure keeps the last known end and logs one line per change of error.

Times: Slurm prints local times without an offset; it runs here under ``TZ=UTC`` and
``SLURM_TIME_FORMAT=standard``, so its times are read as UTC with nothing guessed.
``scontrol update JobId=.. TimeLimit=+5`` moves ``EndTime`` later: at the next ask the
guard sees the release move later and training resumes (a renewal).

The job's partition's ``GraceTime`` (``scontrol show partition -o``, asked once) is kept
in :attr:`SlurmDeadline.grace_seconds`: a preempted job gets SIGTERM and is killed that
long after, so the guard's SIGTERM deadline is never later than it.
"""

from __future__ import annotations

import logging
import os
import subprocess
import threading
import time
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Callable, Optional

from sidecar.slurmtext import (
    job_query,
    parse_end_time,
    parse_job_rows,
    parse_record,
    run_command,
)
from sidecar.train.deadlines import PROCESS, Candidate, earliest
from sidecar.train.sigterm import SigtermDeadline

__all__ = ["ASK_SECONDS", "COMMAND_SECONDS", "SlurmDeadline", "job_rank", "with_slurm"]

logger = logging.getLogger("sidecar.train.guard")

ASK_SECONDS = 60.0  # at most one squeue call a minute per job
COMMAND_SECONDS = 10.0


def job_rank(environ: Mapping[str, str]) -> int:
    """This process's rank: ``$RANK`` (torchrun, the guard's own convention), else
    ``$SLURM_PROCID`` (srun), else 0; a value that is not a number counts as 0."""
    for name in ("RANK", "SLURM_PROCID"):
        value = environ.get(name, "").strip()
        if value:
            return int(value) if value.isdigit() else 0
    return 0


class SlurmDeadline:
    """The end of Slurm job ``job_id`` as last read; :meth:`deadline` never waits."""

    def __init__(self, job_id: str, *, ask_seconds: float = ASK_SECONDS,
                 command_seconds: float = COMMAND_SECONDS,
                 run: Callable[[list[str], float], subprocess.CompletedProcess[str]]
                 = run_command,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.job_id = job_id
        self.ask_seconds = ask_seconds
        self._command_seconds = command_seconds
        self._run = run
        self._monotonic = monotonic
        self._end: Optional[float] = None
        #: The partition's GraceTime in seconds once read (None before, or none set).
        self.grace_seconds: Optional[float] = None
        self._asked_partition = False
        #: The guard's SIGTERM deadline, if it watches one: never later than GraceTime.
        self.sigterm: Optional[SigtermDeadline] = None
        self._next_ask: Optional[float] = None
        self._thread: Optional[threading.Thread] = None
        self._said: Optional[str] = None
        #: Slurm client calls made (the cost, docs/sources.md).
        self.calls = 0

    @classmethod
    def from_environ(cls, environ: Optional[Mapping[str, str]], collective: bool,
                     sigterm: Optional[SigtermDeadline] = None) -> Optional[SlurmDeadline]:
        """One for this process inside a Slurm job (``environ``, default ``os.environ``),
        else None; with a vote across ranks (``collective``) only rank 0 asks. ``sigterm``:
        the guard's SIGTERM deadline, shortened to the partition's GraceTime."""
        environ = os.environ if environ is None else environ
        job_id = environ.get("SLURM_JOB_ID", "").strip()
        if not job_id or (collective and job_rank(environ) != 0):
            return None
        found = cls(job_id)
        found.sigterm = sigterm
        return found

    def deadline(self) -> Optional[float]:
        """The job's end as last read (Unix seconds; None: not yet known, or no time
        limit); starts a background ask when one is due."""
        now = self._monotonic()
        due = self._next_ask is None or now >= self._next_ask
        if due and (self._thread is None or not self._thread.is_alive()):
            self._next_ask = now + self.ask_seconds
            self._thread = threading.Thread(target=self.ask, name="sidecar-slurm", daemon=True)
            self._thread.start()
        return self._end

    @property
    def last_known(self) -> Optional[float]:
        """The end as last read, without asking."""
        return self._end

    def wait_asked(self, seconds: float) -> None:
        """Wait for the ask in flight (tests, and a first decision that may wait)."""
        thread = self._thread
        if thread is not None:
            thread.join(seconds)

    def ask(self) -> None:
        """Ask slurmctld once (in the calling thread); never raises."""
        try:
            rows = parse_job_rows(self._command(job_query(self.job_id)))
            if not rows:
                raise ValueError("no line in squeue's answer")
            # An array's or heterogeneous job's id prints a row per part: the earliest end.
            running = [row for row in rows if row.running]
            ends = [parse_end_time(row.end) for row in running]
            known = [end for end in ends if end is not None]
            end = (min(known) if known else None) if running else self._end
            first = (running or rows)[0]
            if not self._asked_partition and first.partition:
                self._asked_partition = True
                self._read_grace(first.partition)
        except (OSError, ValueError, subprocess.SubprocessError) as exc:
            self._say(f"Slurm job {self.job_id}: cannot read its end time ({_one_line(exc)}); "
                      "the last known one is kept", logging.WARNING)
            return
        if end != self._end:
            self._end = end
            when = "no time limit" if end is None else \
                f"ends at {datetime.fromtimestamp(end, timezone.utc):%Y-%m-%d %H:%M:%S} UTC"
            self._say(f"Slurm job {self.job_id} {when} (time limit {first.time_limit})",
                      logging.INFO)

    def _read_grace(self, partition: str) -> None:
        try:
            grace = parse_record(self._command(["scontrol", "show", "partition", "-o",
                                                partition])).get("GraceTime", "")
        except (OSError, subprocess.SubprocessError, ValueError):
            return  # the time limit matters more; GraceTime is a refinement
        if grace.isdigit() and int(grace) > 0:
            self.grace_seconds = float(grace)

    def _command(self, command: list[str]) -> str:
        self.calls += 1
        try:
            done = self._run(command, self._command_seconds)
        except subprocess.TimeoutExpired:
            raise ValueError(f"no answer within {self._command_seconds:g} s") from None
        if done.returncode != 0:
            said = (done.stderr.strip() or done.stdout.strip()).splitlines()
            raise ValueError(said[0][:200] if said else f"exit status {done.returncode}")
        return done.stdout

    def _say(self, line: str, level: int) -> None:
        if line != self._said:  # once per change, not once a minute
            self._said = line
            logger.log(level, "%s", line)


def with_slurm(slurm: Optional[SlurmDeadline], daemon_answers: bool,
               held: Optional[Candidate], *, ask: bool = False) -> Optional[Candidate]:
    """The earlier of the deadline ``held`` and the Slurm job's end (source ``"slurm"``,
    a process's) while no daemon answers (``sidecar.train.deadlines.earliest``); ``ask``:
    start an ask when one is due (else the last known end). A partition GraceTime shorter
    than the SIGTERM grace shortens the SIGTERM deadline."""
    if slurm is None or daemon_answers:
        return held
    end = slurm.deadline() if ask else slurm.last_known
    grace, sigterm = slurm.grace_seconds, slurm.sigterm
    if sigterm is not None and grace is not None and grace < sigterm.grace_seconds:
        logger.info("SIGTERM deadline: the partition's GraceTime, %g s", grace)
        sigterm.grace_seconds = grace
    return earliest([held, None if end is None else Candidate(end, "slurm", PROCESS)])


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:200] or type(exc).__name__
