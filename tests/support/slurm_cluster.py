"""A private single-node Slurm cluster for the tests: its own munged, slurmctld and slurmd.

Debian's ``slurm-wlm`` and ``munge`` (installed by ``.ci/run``); everything lives in one
short temporary folder (a munge socket path must fit in 108 bytes), the daemons listen on
free loopback ports, and every client command gets ``SLURM_CONF`` pointing at the
generated ``slurm.conf``. No cgroups, no accounting: ``proctrack/linuxproc`` and
``task/none`` run in a plain container as root. Ready once ``sinfo`` shows the node
idle; :meth:`SlurmCluster.stop` cancels the jobs and ends the daemons it started.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Optional

# One binary per package, for the skip message and .ci/run's list.
REQUIRED = {"munged": "munge", "slurmctld": "slurmctld", "slurmd": "slurmd",
            "sbatch": "slurm-client", "scontrol": "slurm-client"}
START_SECONDS = 60.0


def missing_tools() -> list[str]:
    """The Debian packages whose binaries are not on PATH (empty: a cluster can start)."""
    return sorted({package for tool, package in REQUIRED.items()
                   if shutil.which(tool) is None})


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


class SlurmCluster:
    """One controller and one node (this host, as ``node``) in ``folder``."""

    def __init__(self, folder: Path, *, node: str = "", cpus: Optional[int] = None,
                 grace_seconds: int = 0, kill_wait_seconds: int = 5) -> None:
        self.folder = folder
        self.node = node or socket.gethostname().split(".")[0]
        self.cpus = cpus or max(1, os.cpu_count() or 1)
        self.grace_seconds = grace_seconds
        self.kill_wait_seconds = kill_wait_seconds
        self.conf = folder / "slurm.conf"
        self.munge_socket = folder / "munge.sock"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf), "TZ": "UTC"}
        self._daemons: list[tuple[str, subprocess.Popen[bytes]]] = []

    # ------------------------------------------------------------------ start, stop

    def start(self) -> None:
        for sub in ("state", "spool", "log", "jobs"):
            (self.folder / sub).mkdir(parents=True, exist_ok=True)
        key = self.folder / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        self._spawn("munged", ["munged", "-F", "-f", f"--key-file={key}",
                               f"--socket={self.munge_socket}",
                               f"--pid-file={self.folder / 'munged.pid'}",
                               f"--log-file={self.folder / 'log' / 'munged.log'}",
                               f"--seed-file={self.folder / 'munged.seed'}"])
        self._wait(lambda: self.munge_socket.exists(), "munged's socket")
        self.conf.write_text(self._slurm_conf())
        self._spawn("slurmctld", ["slurmctld", "-D", "-i"])
        self._spawn("slurmd", ["slurmd", "-D", "-N", self.node])
        self._wait(lambda: self.node_state() == "idle", f"node {self.node} idle in sinfo")

    def _slurm_conf(self) -> str:
        folder, log = self.folder, self.folder / "log"
        ctld, node = _free_port(), _free_port()
        return "\n".join([
            "ClusterName=esitest",
            f"SlurmctldHost={self.node}(127.0.0.1)",
            f"SlurmctldPort={ctld}",
            f"SlurmdPort={node}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            f"AuthInfo=socket={self.munge_socket}",
            "CredType=cred/munge",
            f"StateSaveLocation={folder / 'state'}",
            f"SlurmdSpoolDir={folder / 'spool'}",
            f"SlurmctldPidFile={folder / 'slurmctld.pid'}",
            f"SlurmdPidFile={folder / 'slurmd.pid'}",
            f"SlurmctldLogFile={log / 'slurmctld.log'}",
            f"SlurmdLogFile={log / 'slurmd.log'}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "MpiDefault=none",
            "SwitchType=switch/none",
            "SchedulerType=sched/backfill",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "MinJobAge=30",
            f"KillWait={self.kill_wait_seconds}",
            "ReturnToService=2",
            f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory=1000 "
            "State=UNKNOWN",
            f"PartitionName=debug Nodes={self.node} Default=YES MaxTime=INFINITE State=UP "
            f"GraceTime={self.grace_seconds}",
            "",
        ])

    def _spawn(self, name: str, command: list[str]) -> None:
        out = open(self.folder / "log" / f"{name}.out", "wb")  # noqa: SIM115 (kept by Popen)
        with out:
            process = subprocess.Popen(command, env=self.env, stdout=out,
                                       stderr=subprocess.STDOUT, start_new_session=True)
        self._daemons.append((name, process))

    def _wait(self, done: object, what: str, seconds: float = START_SECONDS) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            for name, process in self._daemons:
                if process.poll() is not None:
                    raise RuntimeError(f"{name} exited ({process.returncode}) while waiting "
                                       f"for {what}:\n{self.logs()}")
            if done():  # type: ignore[operator]
                return
            time.sleep(0.2)
        raise RuntimeError(f"no {what} within {seconds:g} s:\n{self.logs()}")

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            if self.running():
                self.run("scancel", "--user=root", check=False)
                self._wait(lambda: not self.jobs(), "every job gone", 30.0)
        for _name, process in reversed(self._daemons):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(10)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait(5)
        self._daemons.clear()

    def running(self) -> bool:
        return any(process.poll() is None for _name, process in self._daemons)

    def stop_controller(self) -> None:
        """End slurmctld only (slurmctld down: the clients fail, the node runs on)."""
        for name, process in self._daemons:
            if name == "slurmctld" and process.poll() is None:
                process.send_signal(signal.SIGTERM)
                process.wait(15)

    def logs(self) -> str:
        parts = []
        for path in sorted((self.folder / "log").glob("*")):
            text = path.read_text(errors="replace").splitlines()[-15:]
            parts.append(f"--- {path.name}\n" + "\n".join(text))
        return "\n".join(parts)

    # ------------------------------------------------------------------ clients

    def run(self, *command: str, check: bool = True, timeout: float = 30.0
            ) -> subprocess.CompletedProcess[str]:
        """A Slurm client command against this cluster."""
        done = subprocess.run(list(command), env=self.env, capture_output=True, text=True,
                              timeout=timeout, check=False)
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)}: exit {done.returncode}: "
                               f"{done.stderr.strip() or done.stdout.strip()}")
        return done

    def node_state(self) -> str:
        try:
            done = self.run("sinfo", "-h", "-n", self.node, "-o", "%T", check=False,
                            timeout=10)
        except subprocess.TimeoutExpired:
            return ""
        return done.stdout.strip()

    def submit(self, script: str, *sbatch_args: str, env: Optional[dict[str, str]] = None
               ) -> str:
        """sbatch ``script`` (a bash script body); the job id."""
        path = self.folder / "jobs" / f"job-{time.monotonic_ns()}.sh"
        path.write_text("#!/bin/bash\n" + script)
        # The job runs in, and by default writes its output to, the cluster's own folder:
        # never the folder the tests were started from (the repository).
        jobs = path.parent
        command = ["sbatch", "--parsable", f"--chdir={jobs}",
                   f"--output={jobs / 'slurm-%j.out'}", *sbatch_args, str(path)]
        done = subprocess.run(command, env={**self.env, **(env or {})}, capture_output=True,
                              text=True, timeout=30, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"sbatch: {done.stderr.strip()}")
        return done.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job -o`` as fields ({} once the job is forgotten)."""
        done = self.run("scontrol", "show", "job", "-o", job_id, check=False)
        fields: dict[str, str] = {}
        for word in done.stdout.split():
            name, sep, value = word.partition("=")
            if sep and name not in fields:
                fields[name] = value
        return fields

    def jobs(self) -> list[str]:
        done = self.run("squeue", "-h", "-o", "%i", check=False)
        return done.stdout.split()

    def wait_job(self, job_id: str, states: tuple[str, ...], seconds: float) -> dict[str, str]:
        """Poll until the job's JobState is one of ``states``; its fields then."""
        deadline = time.monotonic() + seconds
        fields: dict[str, str] = {}
        while time.monotonic() < deadline:
            fields = self.job(job_id)
            if fields.get("JobState") in states:
                return fields
            time.sleep(0.5)
        raise AssertionError(f"job {job_id} not in {states} within {seconds:g} s: {fields}\n"
                             f"{self.logs()}")


@contextlib.contextmanager
def running_cluster(**options: object) -> Iterator[SlurmCluster]:
    """A started cluster in a fresh short folder under /tmp, stopped and removed after."""
    folder = Path(tempfile.mkdtemp(prefix="slurm-", dir="/tmp"))
    cluster = SlurmCluster(folder, **options)  # type: ignore[arg-type]
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(folder, ignore_errors=True)
