"""The checkpoint waits for the job (issue 40, item 2): the follower brings the newest durable
checkpoint into the job's folder before the job starts, never visible half copied, only
the changed files of a newer one, owned by the folder's owner, never over the job's
entries, and it stops for good once a job writes there."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_harness import wait_for
from upload_support import MIB, S3Server, commit_to_s3, isolate_aws_env, make_checkpoint

from sidecar.checkpoint.folders import atomic_checkpoint, latest_valid, list_checkpoints
from sidecar.host.upload.follow_sources import S3Source, VolumeSource
from sidecar.host.upload.follower import Follower
from sidecar.host.upload.location import S3Location

OWNER = (4321, 4321)  # the job's user: not the daemon's (root)
FILES = {f"shard-{i}.bin": MIB for i in range(8)}


@pytest.fixture
def job_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "local-disk"
    folder.mkdir()
    os.chown(folder, *OWNER)
    return folder


@pytest.fixture
def volume(tmp_path: Path) -> Path:
    folder = tmp_path / "volume"
    folder.mkdir()
    return folder


@pytest.fixture
def follow(job_folder: Path, volume: Path) -> Iterator[list[Follower]]:
    made: list[Follower] = []
    yield made
    for follower in made:
        follower.stop(timeout=10)


def start(made: list[Follower], job_folder: Path, volume: Path,
          bandwidth: int | None = None) -> Follower:
    follower = Follower(job_folder, VolumeSource(volume, max_bandwidth=bandwidth),
                        interval_seconds=0.05)
    made.append(follower)
    follower.start()
    return follower


def entries(folder: Path) -> set[str]:
    return set(os.listdir(folder))


def test_a_job_polling_latest_valid_never_sees_a_partial_checkpoint(
        job_folder: Path, volume: Path, follow: list[Follower]) -> None:
    remote = make_checkpoint(volume, 100, FILES)
    seen: list[tuple[int | None, list[str]]] = []
    done = threading.Event()

    def job() -> None:  # the job side, as a resuming trainer looks
        while not done.is_set():
            info = latest_valid(job_folder, verify_checksums=True)
            broken = [str(listing.path) for listing in list_checkpoints(job_folder)
                      if not listing.valid]
            seen.append((None if info is None else info.step, broken))
            if info is not None:
                return

    poller = threading.Thread(target=job)
    poller.start()
    follower = start(follow, job_folder, volume, bandwidth=8 * MIB)  # about a second
    try:
        wait_for(lambda: not poller.is_alive(), timeout=30)
    finally:
        done.set()
        poller.join(10)
    assert seen[-1][0] == 100
    assert sum(1 for step, _ in seen if step is None) > 10  # it looked while copying
    assert all(not broken for _, broken in seen)  # never a folder that is not whole
    brought = follower.brought[0]
    assert (brought.name, brought.fetched_bytes, brought.linked_bytes) == (
        remote.name, 8 * MIB, 0)
    wait_for(lambda: entries(job_folder) == {remote.name, "latest"})  # nothing else left
    for path in [job_folder / remote.name, *(job_folder / remote.name).rglob("*"),
                 job_folder / "latest"]:
        found = os.lstat(path)
        assert (found.st_uid, found.st_gid) == OWNER, path
    assert os.lstat(job_folder / remote.name / "shard-0.bin").st_mode & 0o777 == 0o444
    assert (job_folder / "latest").read_text() == f"{remote.name}\n"


def test_a_newer_checkpoint_brings_only_the_changed_files(
        job_folder: Path, volume: Path, follow: list[Follower]) -> None:
    first = make_checkpoint(volume, 100, FILES)
    follower = start(follow, job_folder, volume)
    wait_for(lambda: len(follower.brought) == 1)
    kept = os.lstat(job_folder / first.name / "shard-1.bin").st_ino
    # The next save on the volume: one shard changed, seven the same bytes.
    save = atomic_checkpoint(volume, 200, checksum=True)
    with save as folder:
        for name in FILES:
            data = os.urandom(MIB) if name == "shard-0.bin" else \
                (first.path / name).read_bytes()
            (folder / name).write_bytes(data)
    wait_for(lambda: len(follower.brought) == 2)
    second = follower.brought[1]
    assert (second.step, second.fetched_bytes, second.linked_bytes) == (200, MIB, 7 * MIB)
    assert os.lstat(job_folder / save.name / "shard-1.bin").st_ino == kept  # linked
    wait_for(lambda: entries(job_folder) == {save.name, "latest"})  # the old copy went
    info = latest_valid(job_folder, verify_checksums=True)
    assert info is not None and info.step == 200


def test_a_job_that_starts_saving_stops_the_follower_and_its_copy_never_appears(
        job_folder: Path, volume: Path, follow: list[Follower]) -> None:
    make_checkpoint(volume, 100, {name: 4 * MIB for name in FILES})  # 32 MiB at 4 MiB/s
    follower = start(follow, job_folder, volume, bandwidth=4 * MIB)
    wait_for(lambda: any(name.startswith(".tmp-follow.") for name in entries(job_folder)))
    with atomic_checkpoint(job_folder, 7) as folder:  # the job's first save begins
        (folder / "weights.bin").write_bytes(b"job")
        wait_for(lambda: follower.stopped_because is not None)
    assert "a job writes" in (follower.stopped_because or "")
    wait_for(lambda: not follower.alive())
    assert entries(job_folder) == {"step_00000007", "latest"}  # the job's alone
    info = latest_valid(job_folder)
    assert info is not None and info.step == 7
    assert follower.brought == []


def test_a_new_entry_of_the_job_stops_the_follower_before_it_copies(
        job_folder: Path, volume: Path, follow: list[Follower]) -> None:
    follower = start(follow, job_folder, volume)  # nothing durable yet: it waits
    wait_for(lambda: follower.status()["following"])
    (job_folder / "notes.txt").write_text("the job is here")
    wait_for(lambda: not follower.alive())
    assert "a job made notes.txt" in (follower.stopped_because or "")
    make_checkpoint(volume, 100, FILES)
    assert entries(job_folder) == {"notes.txt"}


def test_the_follower_never_writes_over_or_through_the_jobs_links(
        job_folder: Path, volume: Path, tmp_path: Path, follow: list[Follower]) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    secret = tmp_path / "secret"
    secret.write_text("root's")
    remote = make_checkpoint(volume, 100, FILES)
    (job_folder / remote.name).symlink_to(elsewhere)  # a trap under the checkpoint's name
    (job_folder / "latest").symlink_to(secret)
    follower = start(follow, job_folder, volume)
    wait_for(lambda: remote.name in follower._refused)
    assert list(elsewhere.iterdir()) == []
    assert secret.read_text() == "root's" and os.stat(secret).st_uid == 0
    assert os.path.islink(job_folder / remote.name)
    assert follower.brought == []
    wait_for(lambda: not any(n.startswith(".tmp-follow.") for n in entries(job_folder)))


def test_from_s3_the_follower_brings_the_newest_durable_checkpoint(
        s3: S3Server, bucket: S3Location, job_folder: Path, tmp_path: Path,
        follow: list[Follower], monkeypatch: pytest.MonkeyPatch) -> None:
    isolate_aws_env(monkeypatch)
    for step in (100, 200):
        commit_to_s3(s3, bucket, make_checkpoint(tmp_path / "old-machine", step, FILES))
    follower = Follower(job_folder, S3Source(s3.storage(), bucket), interval_seconds=0.05)
    follow.append(follower)
    follower.start()
    wait_for(lambda: len(follower.brought) == 1, timeout=30)
    info = latest_valid(job_folder, verify_checksums=True)
    assert info is not None and info.step == 200
    assert os.lstat(info.path / "shard-3.bin").st_uid == OWNER[0]
    wait_for(lambda: entries(job_folder) == {info.name, "latest"})
