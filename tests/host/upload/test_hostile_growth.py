"""The job's folder is hostile input: what it can make grow on the host stays bounded
(issue 35, item 4). Hundreds of folders named like saves in progress once made the root
daemon hold every inotify instance root may have on the host (``max_user_instances``),
start two threads each, and take 31 s to make a real checkpoint durable. Here the real
uploader watches a real folder, the "job" makes 400 such folders, and the daemon's
inotify instances and threads stay at a small constant while a real checkpoint saved
beside them is still streamed and made durable.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import pytest
from daemon_harness import wait_for

from sidecar.checkpoint.folders import atomic_checkpoint
from sidecar.host.upload.stream import (
    MAX_DEPTH,
    MAX_ENTRIES_PER_SAVE,
    MAX_SAVES_FOLLOWED,
    FolderId,
    StreamWatcher,
)
from sidecar.host.upload.uploader import Uploader, UploaderConfig
from sidecar.host.upload.volume import VolumeDestination
from sidecar.host.upload.watch import FolderWatch

MIB = 1 << 20
DECOYS = 400
MAX_INOTIFY_INSTANCES = 2  # the uploader's one, and one spare for a restart
MAX_NEW_THREADS = 8  # the upload thread, the inotify reader, and room for copies

pytestmark = pytest.mark.skipif(not Path("/proc/self/fd").is_dir(),
                                reason="counts inotify instances in /proc (Linux)")


def inotify_instances() -> int:
    """inotify instances this process holds: its descriptors that link to one."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:inotify"
        except OSError:
            continue  # closed meanwhile (the listing's own descriptor among them)
    return count


def make_decoys(root: Path, count: int) -> None:
    """What a hostile job makes: empty folders named as atomic_checkpoint names its
    temporary folders (``.tmp-<name>.<host>-<pid>-<start>.<token>``)."""
    for step in range(count):
        (root / f".tmp-step_{step:08d}.0badf00d-{4000 + step}-{step}.{step:08x}").mkdir()


@contextmanager
def running_uploader(root: Path, volume: Path) -> Iterator[Uploader]:
    config = UploaderConfig(root=root, location=None, scan_interval_seconds=0.2,
                            settle_seconds=0.2, backoff_base_seconds=0.05,
                            backoff_cap_seconds=0.3)
    uploader = Uploader(config, destination=VolumeDestination(volume))
    uploader.start()
    try:
        yield uploader
    finally:
        uploader.stop(timeout=5)


def state(uploader: Uploader, name: str) -> Optional[str]:
    record = uploader.tracker.get(name)
    return record.state if record else None


def staged(volume: Path) -> list[str]:
    """Files at the volume's staging place: sent while their save still writes (listed
    with os.walk, which skips a folder that goes while it looks)."""
    return [os.path.join(folder, name) for folder, _, names in os.walk(volume)
            for name in names if os.path.relpath(folder, volume).startswith(".tmp-")]


class Peak:
    """The most inotify instances and threads seen while waiting."""

    def __init__(self) -> None:
        self.instances = self.threads = 0

    def sample(self) -> None:
        self.instances = max(self.instances, inotify_instances())
        self.threads = max(self.threads, threading.active_count())


def test_four_hundred_fake_saves_hold_one_inotify_instance_and_a_few_threads(
    tmp_path: Path,
) -> None:
    root, volume = tmp_path / "local", tmp_path / "volume"
    root.mkdir()
    volume.mkdir()
    instances_before, threads_before = inotify_instances(), threading.active_count()
    peak = Peak()

    def sampled(condition: bool) -> bool:
        peak.sample()
        return condition

    with running_uploader(root, volume) as uploader:
        make_decoys(root, DECOYS)
        data = os.urandom(MIB)
        with atomic_checkpoint(root, 1000, checksum=True) as folder:
            (folder / "model.pt").write_bytes(data)
            # The newest save in progress is still followed: its file goes early.
            wait_for(lambda: sampled(bool(staged(volume))), timeout=30)
        committed = time.monotonic()
        wait_for(lambda: sampled(state(uploader, "step_00001000") == "done"), timeout=60)
        took = time.monotonic() - committed
        peak.sample()
    print(f"\n1 MiB checkpoint durable {took:.2f} s after its commit, beside {DECOYS} "
          f"fake saves; peak {peak.instances - instances_before} inotify instance(s), "
          f"{peak.threads - threads_before} new thread(s)")
    assert (volume / "step_00001000" / "model.pt").read_bytes() == data
    assert peak.instances - instances_before <= MAX_INOTIFY_INSTANCES
    assert peak.threads - threads_before <= MAX_NEW_THREADS
    # Stopped, it holds nothing.
    wait_for(lambda: inotify_instances() <= instances_before, timeout=5)


def test_only_the_newest_saves_in_progress_are_followed_on_the_one_instance(
    tmp_path: Path,
) -> None:
    """400 fake saves, then a real one: the real one is among the few followed, its
    files' close events come through the root's own inotify instance (a subfolder's
    too), and once it commits nothing but the root is watched."""
    root = tmp_path / "local"
    root.mkdir()
    make_decoys(root, DECOYS)
    instances_before = inotify_instances()
    watch = FolderWatch(root, on_change=lambda: None)
    stream = StreamWatcher(root, settle_seconds=3600, watch=watch)  # close events only
    try:
        assert watch.ensure()
        stream.scan()
        save = atomic_checkpoint(root, 1000)
        with save as folder:
            (folder / "sub").mkdir()
            stream.scan()
            followed = [save for save in stream.saves.values() if save.name == "step_00001000"]
            assert len(stream.saves) == MAX_SAVES_FOLLOWED and len(followed) == 1
            # The root, three decoys, the save and its subfolder.
            assert watch.watches() == 1 + (MAX_SAVES_FOLLOWED - 1) + 2
            (folder / "sub" / "a.bin").write_bytes(b"x" * 1000)
            wait_for(lambda: "sub/a.bin" in followed[0].closed, timeout=10)
            stream.scan()
            found = stream.ready()
            assert found is not None and found[:2] == (followed[0], "sub/a.bin")
        assert stream.scan() == [] and followed[0].committed
        assert watch.watches() == 1 + MAX_SAVES_FOLLOWED  # a decoy took its place, no more
        assert inotify_instances() == instances_before + 1
    finally:
        stream.stop()
        watch.stop()


def test_normal_streamed_saves_log_no_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Saves streamed and committed, saves that fail midway: nothing at ERROR (watchdog
    logged "queue_events() called when the thread is inactive" when the uploader stopped
    watching a save that had just committed or gone)."""
    root, volume = tmp_path / "local", tmp_path / "volume"
    root.mkdir()
    volume.mkdir()
    caplog.set_level(logging.DEBUG)
    with running_uploader(root, volume) as uploader:
        for step in range(1, 13):
            name = f"step_{step:08d}"
            with contextlib.suppress(RuntimeError), atomic_checkpoint(root, step) as folder:
                (folder / "sub").mkdir()
                (folder / "sub" / "a.bin").write_bytes(os.urandom(MIB))
                wait_for(lambda: staged(volume), timeout=30)
                if step % 2:
                    raise RuntimeError("the save failed")
            if step % 2:
                wait_for(lambda: not staged(volume), timeout=30)
            else:
                wait_for(lambda name=name: state(uploader, name) == "done", timeout=30)
    errors = [record.getMessage() for record in caplog.records
              if record.levelno >= logging.ERROR]
    assert errors == []


# ------------------------------------------------- red team of issue 35: saves in progress


def nested(top: Path, depth: int) -> None:
    """``top/d/d/d/...`` ``depth`` folders deep (made through descriptors: no long paths)."""
    top.mkdir()
    current = os.open(top, os.O_RDONLY)
    try:
        for _ in range(depth):
            os.mkdir("d", dir_fd=current)
            below = os.open("d", os.O_RDONLY, dir_fd=current)
            os.close(current)
            current = below
    finally:
        os.close(current)


def remove_nested(top: Path) -> None:
    """Remove what :func:`nested` made, a level at a time (rmtree recurses too deep)."""
    while (top / "d" / "d").is_dir():
        (top / "d" / "d").rename(top / "below")
        (top / "d").rmdir()
        (top / "below").rename(top / "d")
    if (top / "d").is_dir():
        (top / "d").rmdir()
    top.rmdir()


def save_in_progress(root: Path, step: int) -> Path:
    """A folder named as atomic_checkpoint names a save in progress."""
    return root / f".tmp-step_{step:08d}.0badf00d-{4000 + step}-{step}.{step:08x}"


def test_a_save_with_more_entries_than_followed_is_dropped_and_not_walked_again(
    tmp_path: Path,
) -> None:
    """A job's save of thousands of empty files cost the daemon a walk of all of them
    every scan, and a real checkpoint took 20 s instead of 0.2 s to be durable: beyond
    MAX_ENTRIES_PER_SAVE a save is no longer followed (it goes up once committed)."""
    big = save_in_progress(tmp_path, 7)
    big.mkdir()
    for index in range(MAX_ENTRIES_PER_SAVE + 1):
        os.close(os.open(big / f"f{index:05d}", os.O_CREAT | os.O_WRONLY, 0o644))
    small = save_in_progress(tmp_path, 8)
    small.mkdir()
    (small / "a.bin").write_bytes(b"x")
    stream = StreamWatcher(tmp_path, settle_seconds=0)
    dropped = stream.scan()
    assert [(save.path, save.dropped) for save in dropped] == [
        (big, f"more than {MAX_ENTRIES_PER_SAVE} files and folders")]
    assert [save.path for save in stream.saves.values()] == [small]
    assert stream.scan() == [] and [s.path for s in stream.saves.values()] == [small]
    found = stream.ready()
    assert found is not None and found[1] == "a.bin"


def test_a_save_deeper_than_followed_is_dropped(tmp_path: Path) -> None:
    deep = save_in_progress(tmp_path, 7)
    nested(deep, MAX_DEPTH + 2)
    stream = StreamWatcher(tmp_path, settle_seconds=0)
    dropped = stream.scan()
    assert [save.dropped for save in dropped] == [f"folders more than {MAX_DEPTH} deep"]
    assert stream.saves == {}


class SwappedAfterListing(StreamWatcher):
    """The job wins the race: right after the scan listed its save in progress (a
    folder), the folder is moved aside and a link to a root-only folder takes its name."""

    target: Path

    def _temporary_folders(self) -> dict[FolderId, tuple[Path, str, int]]:
        found = super()._temporary_folders()
        for path, _, _ in found.values():
            if not path.is_symlink():
                path.rename(path.with_name("aside"))
                path.symlink_to(self.target, target_is_directory=True)
        return found


def test_a_link_swapped_in_for_a_save_is_never_walked(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.mkdir(mode=0o700)
    (secret / "hidden-name.txt").write_bytes(b"x")
    root = tmp_path / "local"
    root.mkdir()
    save = save_in_progress(root, 7)
    save.mkdir()
    (save / "a.bin").write_bytes(b"a")
    stream = SwappedAfterListing(root, settle_seconds=0)
    stream.target = secret
    stream.scan()
    keys = [relative for followed in stream.saves.values() for relative in followed.keys]
    assert keys == []  # not the folder listed, so nothing of it (nor of the link's target)


def test_one_hostile_folder_never_stops_the_uploads(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A manifest nested 200,000 deep, a save in progress nested 1,500 deep: each once
    raised RecursionError out of every upload cycle, and nothing was uploaded again. Now
    each is skipped with one warning, and real checkpoints go up beside them."""
    root, volume = tmp_path / "local", tmp_path / "volume"
    root.mkdir()
    volume.mkdir()
    caplog.set_level(logging.INFO, "sidecar.host.upload")
    with running_uploader(root, volume) as uploader:
        (root / "junk").mkdir()
        (root / "junk" / "MANIFEST.json").write_bytes(b"[" * 200_000)
        nested(save_in_progress(root, 50), 1500)
        try:
            for step in (1, 2):  # saved beside and moved in (the job's own cleaning of
                # leftovers would walk the deep folder: leftovers.py, the job's problem)
                with atomic_checkpoint(tmp_path / "other", step) as folder:
                    (folder / "model.pt").write_bytes(os.urandom(1000))
                (tmp_path / "other" / f"step_{step:08d}").rename(root / f"step_{step:08d}")
                wait_for(lambda step=step: state(uploader, f"step_{step:08d}") == "done",
                         timeout=30)
        finally:
            remove_nested(save_in_progress(root, 50))
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert [line for line in warnings if "junk" in line] == [
        "not uploading junk: MANIFEST.json nests too deeply to be a manifest"]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
