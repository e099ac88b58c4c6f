"""The slurm source against a real single-node Slurm cluster (tests/support/slurm_cluster.py):
a job's EndTime is the deadline, an extension moves it later, the daemon serves it, and
a controller that is down or an answer that is garbage is one line, never a hidden
deadline."""

from __future__ import annotations

import calendar
import os
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from daemon_harness import get_json, serve_daemon, wait_for
from slurm_cluster import SlurmCluster, missing_tools, running_cluster

from sidecar.host.sources.base import SourceError
from sidecar.host.sources.registry import auto_candidates, spec
from sidecar.host.sources.slurm import (
    POLL_INTERVAL_SECONDS,
    SlurmConfig,
    SlurmSource,
    build,
    probe,
)
from sidecar.models import KIND_SCHEDULED_RELEASE

pytestmark = pytest.mark.skipif(bool(missing_tools()),
                                reason=f"needs Debian's {', '.join(missing_tools())}")


@pytest.fixture(scope="module")
def cluster() -> Iterator[SlurmCluster]:
    with running_cluster() as started:
        yield started


@pytest.fixture
def slurm_env(cluster: SlurmCluster, monkeypatch: pytest.MonkeyPatch) -> SlurmCluster:
    """The daemon's own environment on a Slurm host: SLURM_CONF, and a zone that is not
    UTC (Slurm prints local times: the source must not read them in this one)."""
    monkeypatch.setenv("SLURM_CONF", str(cluster.conf))
    monkeypatch.setenv("TZ", "Asia/Shanghai")
    time.tzset()
    yield cluster
    monkeypatch.undo()
    time.tzset()


def sleeper(cluster: SlurmCluster, minutes: str, *options: str) -> tuple[str, float]:
    """A running job of ``--time=minutes``; its id and when it started (Unix seconds).

    The start is read without the product's parser: the fixture's clients run under
    ``TZ=UTC``, ``calendar.timegm`` reads the text as UTC, and the instant must lie between
    this process's clock before the submit and after the job ran (an hour's error in the
    zone is 3,600 s outside that window)."""
    before = time.time()
    job = cluster.submit("sleep 3000\n", f"--time={minutes}", "-o", "/dev/null", *options)
    fields = cluster.wait_job(job, ("RUNNING",), 30)
    after = time.time()
    started = float(calendar.timegm(time.strptime(fields["StartTime"], "%Y-%m-%dT%H:%M:%S")))
    assert before - 1 <= started <= after, (before, fields["StartTime"], after)
    return job, started


def test_a_running_job_s_end_time_is_the_deadline_in_utc(slurm_env: SlurmCluster) -> None:
    job, started = sleeper(slurm_env, "3")
    source = SlurmSource(job)
    observation = source.poll()
    assert observation.expires_at_unix == started + 180  # not 8 h off: TZ is Asia/Shanghai
    assert observation.kind == KIND_SCHEDULED_RELEASE and observation.assumed_timezone is None
    assert "time limit 3:00" in (observation.notices[0].detail or "")
    assert source.calls == 1
    slurm_env.run("scancel", job)


def test_a_job_s_name_does_not_set_its_deadline(slurm_env: SlurmCluster) -> None:
    forged = "train EndTime=2099-12-31T00:00:00"
    job, started = sleeper(slurm_env, "3", f"--job-name={forged}")
    record = slurm_env.run("scontrol", "show", "job", "-o", job).stdout
    assert record.index(f"JobName={forged}") < record.index("EndTime=20")  # the forgery
    assert SlurmSource(job).poll().expires_at_unix == started + 180
    on_node = SlurmSource(None, slurm_env.node).poll().notices  # an earlier job may linger
    assert [n.expires_at_unix for n in on_node if f"job {job} " in (n.detail or "")] == [
        started + 180]
    slurm_env.run("scancel", job)


def test_an_extension_moves_the_deadline_later_at_the_next_poll(slurm_env: SlurmCluster) -> None:
    job, started = sleeper(slurm_env, "3")
    source = SlurmSource(job)
    assert source.poll().expires_at_unix == started + 180
    slurm_env.run("scontrol", "update", f"JobId={job}", "TimeLimit=+5")
    assert source.poll().expires_at_unix == started + 480
    slurm_env.run("scancel", job)


def test_without_a_job_id_every_job_on_the_node_counts_and_the_earliest_wins(
    slurm_env: SlurmCluster,
) -> None:
    short, short_start = sleeper(slurm_env, "2")
    long, _ = sleeper(slurm_env, "9")
    observation = SlurmSource(None, slurm_env.node).poll()
    assert observation.expires_at_unix == short_start + 120
    assert {n.detail.split(" ")[1] for n in observation.notices if n.detail} == {short, long}
    slurm_env.run("scancel", short, long)
    wait_for(lambda: SlurmSource(None, slurm_env.node).poll().expires_at_unix is None,
             timeout=30)


def test_a_job_without_a_time_limit_has_no_deadline(slurm_env: SlurmCluster) -> None:
    job, _ = sleeper(slurm_env, "UNLIMITED")
    observation = SlurmSource(job).poll()
    assert observation.expires_at_unix is None
    assert "no time limit" in (observation.notices[0].detail or "")
    slurm_env.run("scancel", job)


def test_a_wrong_job_id_or_node_is_one_clear_line(slurm_env: SlurmCluster) -> None:
    with pytest.raises(SourceError, match="job 999999 is not known to slurmctld"):
        SlurmSource("999999").poll()
    with pytest.raises(SourceError, match="node nosuchnode is not in the cluster"):
        SlurmSource(None, "nosuchnode").poll()


@pytest.mark.parametrize("answer", ["5|RUNNING|tomorrow|1:00|debug",
                                    "5|RUNNING|2099-12-31T00:00:00|1:00|debug|x",
                                    "JobId=5 JobState=RUNNING EndTime=2099-12-31T00:00:00",
                                    "Segmentation fault", ""])
def test_garbage_is_a_source_error_not_a_crash(answer: str) -> None:
    def garbage(command: list[str], seconds: float) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(command, 0, answer, "")

    with pytest.raises(SourceError, match="slurm: "):
        SlurmSource("5", run=garbage).poll()


def test_a_hung_command_costs_one_bounded_poll(tmp_path: Any,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    hung = tmp_path / "squeue"
    hung.write_text("#!/bin/sh\nexec sleep 30\n")
    hung.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    started = time.monotonic()
    with pytest.raises(SourceError, match=r"no answer within 0\.5 s"):
        SlurmSource("5", command_seconds=0.5).poll()
    assert time.monotonic() - started < 3


def test_the_spec_polls_at_most_once_a_minute_on_the_adaptive_schedule() -> None:
    traits = spec("slurm").traits
    assert traits.poll_interval_seconds == POLL_INTERVAL_SECONDS == 60
    assert traits.adaptive and not traits.api_budget
    assert "slurm" in auto_candidates()


def test_auto_probes_a_job_id_or_a_config_and_asks_slurmctld_nothing(tmp_path: Any) -> None:
    config = SlurmConfig(slurm_job_id=None, slurm_node=None)
    assert probe(config, 0.8, {"SLURM_JOB_ID": "7"}) is None
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=x\n")
    assert probe(config, 0.8, {"SLURM_CONF": str(conf)}) is None
    if not any(os.path.isfile(p) for p in ("/etc/slurm/slurm.conf",
                                            "/etc/slurm-llnl/slurm.conf")):
        assert "no Slurm job or config" in str(probe(config, 0.8, {}))
    assert build(config, {"SLURM_JOB_ID": "7", "SLURMD_NODENAME": "gpu3"}).job_id == "7"
    assert build(SlurmConfig("8", None), {"SLURM_JOB_ID": "7"}).job_id == "8"


# ---------------------------------------------------------------------- the daemon


def expiry(daemon: Any) -> Any:
    return get_json(daemon.url + "/v1/expiry")[1]


@pytest.mark.slow
def test_the_daemon_serves_the_time_limit_and_its_extension(slurm_env: SlurmCluster) -> None:
    job, started = sleeper(slurm_env, "10")
    with serve_daemon(sources=("slurm",), source_options={"slurm_job_id": job},
                      poll_interval=30.0) as daemon:
        wait_for(lambda: expiry(daemon)["expires_at_unix"] == started + 600, timeout=20)
        status, health = get_json(daemon.url + "/healthz")
        assert status == 200 and health["sources"]["slurm"]["error"] is None
        body = expiry(daemon)
        assert body["source"] == "slurm" and body["kind"] == KIND_SCHEDULED_RELEASE
        updated = time.monotonic()
        slurm_env.run("scontrol", "update", f"JobId={job}", "TimeLimit=+5")
        wait_for(lambda: expiry(daemon)["expires_at_unix"] == started + 900,
                 timeout=POLL_INTERVAL_SECONDS * 1.1 + 15, interval=0.1)
        latency = time.monotonic() - updated
        metrics = urllib.request.urlopen(daemon.url + "/metrics", timeout=5).read().decode()
    print(f"scontrol update -> served in {latency:.1f} s")
    assert latency <= POLL_INTERVAL_SECONDS * 1.1 + 15
    assert 'esi_sidecar_polls_total{outcome="ok",source="slurm"}' in metrics
    slurm_env.run("scancel", job)


def test_slurmctld_down_is_one_line_and_never_hides_another_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with running_cluster() as own:
        monkeypatch.setenv("SLURM_CONF", str(own.conf))
        job, _started = sleeper(own, "5")
        own.stop_controller()
        with serve_daemon(sources=("slurm", "static"), source_options={"slurm_job_id": job},
                          expires_at=str(time.time() + 3600)) as daemon:
            health = wait_for(lambda: (lambda h: h["sources"].get("slurm", {}).get(
                "error") and h)(get_json(daemon.url + "/healthz")[1]), timeout=40)
            body = expiry(daemon)
        error = health["sources"]["slurm"]["error"]
        assert error.startswith("slurm: ") and "\n" not in error
        assert "Unable to contact slurm controller" in error or "no answer within" in error
        assert body["source"] == "static" and 3500 < body["remaining_seconds"] <= 3600
