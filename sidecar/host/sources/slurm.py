"""Slurm time limits: the ``EndTime`` of the job(s) on this node, asked of slurmctld.

With a job id (``--slurm-job-id``, else ``SLURM_JOB_ID`` in the daemon's environment, as
when the daemon runs inside the job): ``squeue -h -t all -j <id>``. Without one: every
running job on this node (``squeue -h -w <node> -t RUNNING,SUSPENDED...``, the node named by
``--slurm-node``, default the short host name), each one notice, the earliest the
deadline: on a node shared by several jobs a guard then saves for the first job to end,
early for the others, never late (give each job its own daemon with ``--slurm-job-id`` to
avoid that). Both print the fixed format ``sidecar.slurmtext.JOB_FORMAT`` (id, state, end,
limit, partition): no field a job can write, so a job's name cannot forge its end (it can
in ``scontrol show job -o``). A time limit is a scheduled release: ``scontrol update
JobId=.. TimeLimit=+5`` moves ``EndTime`` later, which the poller serves as a renewal.

Slurm prints local times without an offset (in the zone of the process that runs the
client command, ``TZ`` included). The commands run here with ``TZ=UTC`` and
``SLURM_TIME_FORMAT=standard``, so their times are UTC whatever the host's zone or the
user's time format: nothing is guessed.

Polled on the adaptive schedule with a 60 s base (``sidecar.host.schedule``): once a
minute in the final 15 minutes, less often while the end is far (at most 60 squeue
calls per host-hour; docs/sources.md). Each command is bounded (``COMMAND_SECONDS``, its
process killed after), so a slurmctld that is down or hangs costs one failed poll.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from sidecar.host.sources.base import Observation, SourceError
from sidecar.host.sources.spec import Option, SourceSpec, SourceTraits, parse_text
from sidecar.models import (
    DEADLINE_PROCESS,
    KIND_SCHEDULED_RELEASE,
    Notice,
    observation_from_notices,
)
from sidecar.slurmtext import (
    JobRow,
    job_query,
    node_query,
    parse_end_time,
    parse_job_rows,
    run_command,
)

__all__ = ["SPEC", "SlurmConfig", "SlurmSource", "build", "parse_end_time", "probe"]

POLL_INTERVAL_SECONDS = 60.0  # the base of the adaptive schedule: at most once a minute
COMMAND_SECONDS = 10.0  # one squeue call, whole
# Where slurm.conf lives on Debian and in Slurm's default build, for auto's probe.
CONFIG_PATHS = ("/etc/slurm/slurm.conf", "/etc/slurm-llnl/slurm.conf",
                "/usr/local/etc/slurm.conf")

Runner = Callable[[list[str], float], "subprocess.CompletedProcess[str]"]


class SlurmSource:
    """The end of this node's Slurm job(s), from squeue."""

    name = "slurm"
    poll_interval_seconds = POLL_INTERVAL_SECONDS

    def __init__(self, job_id: Optional[str] = None, node: Optional[str] = None, *,
                 command_seconds: float = COMMAND_SECONDS,
                 run: Runner = run_command) -> None:
        self.job_id = job_id
        self.node = node or socket.gethostname().split(".")[0]
        self._seconds = command_seconds
        self._run = run
        #: Client commands run (the cost per host-hour, docs/sources.md).
        self.calls = 0

    def poll(self) -> Observation:
        if self.job_id is not None:
            notices = self._job_notices(self.job_id)
        else:
            notices = self._node_notices()
        return observation_from_notices(notices, instance_id=self.node)

    def _job_notices(self, job_id: str) -> list[Notice]:
        rows = self._rows(job_query(job_id))
        if not rows:
            raise SourceError(f"slurm: squeue -j {job_id}: no line in the answer")
        # Pending or ended: no time limit runs on this node. An array's or a heterogeneous
        # job's id prints one row per part: each running one is a notice, the earliest wins.
        return [self._notice(row) for row in rows if row.running]

    def _node_notices(self) -> list[Notice]:
        return [self._notice(row) for row in self._rows(node_query(self.node))]

    def _rows(self, command: list[str]) -> list[JobRow]:
        out = self._ask(command)
        try:
            return parse_job_rows(out)
        except ValueError as exc:
            raise SourceError(f"slurm: {exc}") from None

    def _notice(self, row: JobRow) -> Notice:
        try:
            end_unix = parse_end_time(row.end)
        except ValueError as exc:
            raise SourceError(f"slurm: job {row.job_id}: {exc}") from None
        where = f" in {row.partition}" if row.partition else ""
        if end_unix is None:
            return Notice(KIND_SCHEDULED_RELEASE, None, detail=f"job {row.job_id}{where}: "
                          f"no time limit (TimeLimit={row.time_limit})")
        return Notice(KIND_SCHEDULED_RELEASE, end_unix,
                      detail=f"job {row.job_id}{where}: time limit {row.time_limit}")

    def _ask(self, command: list[str]) -> str:
        self.calls += 1
        try:
            done = self._run(command, self._seconds)
        except FileNotFoundError:
            raise SourceError(f"slurm: {command[0]} not found on PATH (install slurm-client)"
                              ) from None
        except subprocess.TimeoutExpired:
            raise SourceError(f"slurm: {command[0]} gave no answer within {self._seconds:g} s "
                              "(slurmctld overloaded or unreachable?)") from None
        if done.returncode != 0:
            said = (done.stderr.strip() or done.stdout.strip()).splitlines()
            line = said[0][:200] if said else f"exit status {done.returncode}"
            if "Invalid job id" in line:
                raise SourceError(f"slurm: job {self.job_id} is not known to slurmctld (it "
                                  "ended, or --slurm-job-id is wrong)")
            if "Invalid node name" in line:
                raise SourceError(f"slurm: node {self.node} is not in the cluster (set "
                                  "--slurm-node to this host's Slurm node name)")
            raise SourceError(f"slurm: {' '.join(command[:3])}: {line}")
        return done.stdout


@dataclass(frozen=True)
class SlurmConfig:
    slurm_job_id: Optional[str]
    slurm_node: Optional[str]


def build(config: SlurmConfig, environ: Mapping[str, str] = os.environ) -> SlurmSource:
    job_id = config.slurm_job_id or environ.get("SLURM_JOB_ID") or None
    return SlurmSource(job_id, config.slurm_node or environ.get("SLURMD_NODENAME") or None)


def probe(config: SlurmConfig, timeout: float, environ: Mapping[str, str] = os.environ
          ) -> Optional[str]:
    """None on a Slurm host: squeue on PATH and a job id or a Slurm config (SLURM_CONF,
    or slurm.conf in its usual places). Asks slurmctld nothing: a controller that is down
    is the source's error to report, not a reason to leave it out."""
    if shutil.which("squeue") is None:
        return "no Slurm here (squeue not on PATH)"
    if config.slurm_job_id or environ.get("SLURM_JOB_ID"):
        return None
    conf = environ.get("SLURM_CONF")
    if conf and Path(conf).is_file():
        return None
    if any(Path(path).is_file() for path in CONFIG_PATHS):
        return None
    return "no Slurm job or config here (no SLURM_JOB_ID, SLURM_CONF or slurm.conf)"


def _job_id(value: str) -> str:
    value = parse_text(value)
    if not value.replace("_", "").isdigit():
        raise ValueError("must be a Slurm job id such as 1234 or 1234_5")
    return value


SPEC = SourceSpec(
    name="slurm", config=SlurmConfig, build=build, probe=probe, deadline_kind=DEADLINE_PROCESS,
    summary="Slurm job time limits",
    traits=SourceTraits(poll_interval_seconds=POLL_INTERVAL_SECONDS, adaptive=True),
    options=(
        Option("slurm_job_id", _job_id, "the Slurm job whose time limit is the deadline "
               "(default: $SLURM_JOB_ID, else every job running on --slurm-node)", "ID"),
        Option("slurm_node", parse_text, "this host's Slurm node name, for the slurm "
               "source without a job id (default: the short host name)", "NAME"),
    ),
)
