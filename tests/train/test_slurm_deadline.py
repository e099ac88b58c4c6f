"""The guard inside a Slurm job without a daemon: one rank asks squeue, at most once a
minute, never inside a step, and the end reaches every rank through the vote."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path

import pytest
from guard_support import FakeMonotonic, closed_port
from slurm_cluster import missing_tools, running_cluster

from sidecar.train.client import SidecarClient
from sidecar.train.guard import CheckpointGuard
from sidecar.train.slurm_deadline import ASK_SECONDS, SlurmDeadline, job_rank
from sidecar.train.vote import MIN, Op


def utc(unix: float) -> str:
    return datetime.fromtimestamp(unix, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S")


def fake_slurm(folder: Path, end: str, grace: int = 0) -> Path:
    """squeue and scontrol on PATH that answer for job 42 as Slurm would, and log each
    call; job 42's name forges an end in ``scontrol show job -o``, as a real job's can."""
    calls = folder / "calls"
    scontrol = folder / "scontrol"
    scontrol.write_text(
        "#!/bin/sh\n"
        f'echo "$TZ scontrol $*" >> {calls}\n'
        'if [ "$2" = partition ]; then\n'
        f'  echo "PartitionName=p GraceTime={grace} State=UP"; exit 0\n'
        "fi\n"
        'echo "JobId=42 JobName=x EndTime=2099-12-31T00:00:00 JobState=RUNNING '
        f'TimeLimit=00:03:00 EndTime={end} Partition=p"\n')
    squeue = folder / "squeue"
    squeue.write_text(
        "#!/bin/sh\n"
        f'echo "$TZ squeue $*" >> {calls}\n'
        f'echo "42|RUNNING|{end}|3:00|p"\n')
    for script in (scontrol, squeue):
        script.chmod(0o755)
    return calls


@pytest.fixture
def on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    return tmp_path


def test_only_rank_0_asks_when_the_ranks_vote() -> None:
    job = {"SLURM_JOB_ID": "42"}
    assert SlurmDeadline.from_environ({**job, "RANK": "1"}, True) is None
    assert SlurmDeadline.from_environ({**job, "SLURM_PROCID": "0"}, True) is not None
    assert SlurmDeadline.from_environ({**job, "RANK": "3"}, False) is not None  # no vote
    assert SlurmDeadline.from_environ({"RANK": "0"}, True) is None
    assert job_rank({"RANK": "2", "SLURM_PROCID": "5"}) == 2 and job_rank({}) == 0


def test_the_end_is_read_in_utc_in_the_background_at_most_once_a_minute(on_path: Path) -> None:
    end = time.time() + 100
    calls = fake_slurm(on_path, utc(end), grace=30)
    monotonic = FakeMonotonic()
    slurm = SlurmDeadline("42", monotonic=monotonic)
    assert slurm.deadline() is None  # the ask runs in its thread: nothing waits for it
    slurm.wait_asked(10)
    assert slurm.deadline() == int(end) and slurm.grace_seconds == 30
    for _ in range(100):
        slurm.deadline()
        monotonic.advance(0.5)  # 50 s in all: still inside the minute
    slurm.wait_asked(10)
    monotonic.advance(ASK_SECONDS)
    slurm.deadline()
    slurm.wait_asked(10)
    lines = calls.read_text().splitlines()
    ask = "UTC squeue -h -t all -j 42 -o %i|%T|%e|%l|%P"
    assert lines == [ask, "UTC scontrol show partition -o p", ask]


def test_a_failing_squeue_keeps_the_last_end_and_says_so_once(
    on_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    end = time.time() + 100
    fake_slurm(on_path, utc(end))
    monotonic = FakeMonotonic()
    slurm = SlurmDeadline("42", monotonic=monotonic)
    slurm.deadline()
    slurm.wait_asked(10)
    (on_path / "squeue").write_text("#!/bin/sh\necho 'slurm_load_jobs error: Unable to "
                                    "contact slurm controller' >&2\nexit 1\n")
    for _ in range(3):
        monotonic.advance(ASK_SECONDS)
        assert slurm.deadline() == int(end)
        slurm.wait_asked(10)
    warnings = [r.getMessage() for r in caplog.records if "cannot read" in r.getMessage()]
    assert warnings == ["Slurm job 42: cannot read its end time (slurm_load_jobs error: "
                        "Unable to contact slurm controller); the last known one is kept"]


def test_a_hung_squeue_never_holds_a_step(on_path: Path) -> None:
    (on_path / "squeue").write_text("#!/bin/sh\nexec sleep 30\n")
    (on_path / "squeue").chmod(0o755)
    guard = CheckpointGuard(SidecarClient(f"http://127.0.0.1:{closed_port()}"),
                            environ={"SLURM_JOB_ID": "42"}, events=False)
    started = time.monotonic()
    for _ in range(20):
        guard.should_save()
    assert time.monotonic() - started < 2.0


class TwoRanks:
    """An in-process all-reduce of two "ranks" in threads."""

    def __init__(self) -> None:
        self.barrier = threading.Barrier(2, timeout=10)
        self.slots: list[Sequence[float]] = [(), ()]

    def for_rank(self, rank: int):  # type: ignore[no-untyped-def]
        def reduce(values: Sequence[float], ops: Sequence[Op], /) -> list[float]:
            self.slots[rank] = tuple(values)
            self.barrier.wait()
            columns = list(zip(*self.slots))
            self.barrier.wait()
            return [min(c) if op == MIN else max(c) for op, c in zip(ops, columns)]

        return reduce


def test_the_end_reaches_every_rank_through_the_vote(on_path: Path) -> None:
    end = time.time() + 500
    calls = fake_slurm(on_path, utc(end))
    ranks = TwoRanks()
    url = f"http://127.0.0.1:{closed_port()}"  # no daemon answers
    seen: dict[int, float] = {}

    def train(rank: int) -> None:
        guard = CheckpointGuard(SidecarClient(url), reducer=ranks.for_rank(rank),
                                environ={"SLURM_JOB_ID": "42", "RANK": str(rank)},
                                events=False)
        for _ in range(200):
            guard.should_save()
            remaining = guard.last_decision.remaining_seconds  # type: ignore[union-attr]
            if remaining is not None:
                seen[rank] = remaining
                return
            time.sleep(0.02)

    threads = [threading.Thread(target=train, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert set(seen) == {0, 1} and abs(seen[0] - seen[1]) < 1.0 and 490 < seen[1] <= 500
    assert calls.read_text().count("squeue") == 1  # rank 0 only


@pytest.mark.skipif(bool(missing_tools()), reason=f"needs Debian's {', '.join(missing_tools())}")
def test_a_real_job_s_end_and_grace_time(monkeypatch: pytest.MonkeyPatch) -> None:
    with running_cluster(grace_seconds=45) as cluster:
        # Named to forge its end in `scontrol show job -o`: the first EndTime there is 2099.
        job = cluster.submit("sleep 300\n", "--time=4", "-o", "/dev/null",
                             "--job-name=train EndTime=2099-12-31T00:00:00")
        fields = cluster.wait_job(job, ("RUNNING",), 30)
        monkeypatch.setenv("SLURM_CONF", str(cluster.conf))
        monkeypatch.setenv("TZ", "America/Los_Angeles")  # Slurm would print this zone
        time.tzset()
        try:
            slurm = SlurmDeadline(job)
            slurm.ask()
        finally:
            monkeypatch.undo()
            time.tzset()
        started = datetime.strptime(fields["StartTime"], "%Y-%m-%dT%H:%M:%S")
        assert slurm.last_known == started.replace(tzinfo=timezone.utc).timestamp() + 240
        assert slurm.grace_seconds == 45 and slurm.calls == 2
