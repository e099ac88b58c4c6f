"""The job's folder is hostile input (issue 35, part A): the root uploader never writes
through a link the job planted, never lets one pin damage a durable checkpoint or the
volume's marker, never reads a file the job's user could not read (a hard link, another
user's file), and never writes a log line a file name forged. The job is played by uid
65534 where ownership matters (the tests run as root, as the daemon does).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional

import pytest
from daemon_harness import wait_for
from upload_support import record, state, uploading

from sidecar.checkpoint.folders import atomic_checkpoint, latest_valid
from sidecar.checkpoint.manifest import UPLOADING_MARKER, CheckpointInfo
from sidecar.host.logs import hold_back_repeats
from sidecar.host.upload.identity import VOLUME_MARKER
from sidecar.host.upload.status import UploadRecord, UploadTracker
from sidecar.host.upload.uploader import Uploader, UploaderConfig
from sidecar.host.upload.volume import VolumeDestination

REPO = Path(__file__).resolve().parents[3]
JOB_UID = 65534  # nobody: the training job
SECRET = b"root-only: the daemon's token 7f3a\n"

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="plays root and the job's uid")


@pytest.fixture(autouse=True)
def _umask() -> Iterator[None]:
    """Files the tests write as root are world-readable unless a test says otherwise."""
    old = os.umask(0o022)
    yield
    os.umask(old)


def job_root(tmp_path: Path) -> Path:
    """The upload-from folder, owned by the job's user."""
    local = tmp_path / "local"
    local.mkdir()
    os.chown(local, JOB_UID, JOB_UID)
    return local


def root_only(path: Path, data: bytes = SECRET) -> Path:
    path.write_bytes(data)
    os.chmod(path, 0o600)
    return path


def save(root: Path, step: int, files: dict[str, bytes], *,
         plant: Optional[dict[str, Path]] = None,
         links: Optional[dict[str, Path]] = None) -> CheckpointInfo:
    """A checkpoint the job saves (its files owned by the job): ``plant`` adds symbolic
    links (name -> target) and ``links`` hard links before the commit."""
    checkpoint = atomic_checkpoint(root, step, checksum=True)
    with checkpoint as folder:
        for relative, data in files.items():
            (folder / relative).parent.mkdir(parents=True, exist_ok=True)
            (folder / relative).write_bytes(data)
            os.chown(folder / relative, JOB_UID, JOB_UID)
        for relative, target in (links or {}).items():
            os.link(target, folder / relative)
        for name, target in (plant or {}).items():
            os.symlink(target, folder / name)
    assert checkpoint.info is not None
    return checkpoint.info



def settled(uploader: Uploader, name: str) -> Optional[str]:
    """Wait until ``name`` is done, failed or skipped; its state."""
    wait_for(lambda: state(uploader, name) in ("done", "failed", "skipped"), timeout=20)
    return state(uploader, name)


def restore(volume: Path, into: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sidecar.cli", "restore", "--from", volume.as_uri(),
         "--to", str(into)], capture_output=True, text=True, cwd=REPO, timeout=60)


# ---------------------------------------------------------------- item 1: the pin


@needs_root
def test_a_planted_uploading_link_is_never_written_through(tmp_path: Path) -> None:
    """``.uploading`` -> a root-only file: the upload is done, the file is byte-identical
    (mode too), and the job's link is left as it was."""
    local, volume = job_root(tmp_path), tmp_path / "volume"
    volume.mkdir()
    target = root_only(tmp_path / "shadow")
    info = save(local, 1, {"model.pt": os.urandom(4000)},
                plant={UPLOADING_MARKER: target})
    with uploading(local, VolumeDestination(volume)) as uploader:
        wait_for(lambda: state(uploader, info.name) == "done", timeout=20)
    assert target.read_bytes() == SECRET
    assert target.stat().st_mode & 0o777 == 0o600
    assert os.readlink(info.path / UPLOADING_MARKER) == str(target)
    assert latest_valid(volume, verify_checksums=True).step == 1  # type: ignore[union-attr]


@needs_root
def test_the_pin_is_created_and_removed_by_this_run_only(tmp_path: Path) -> None:
    """Without a planted entry the folder is pinned while it uploads (a regular file the
    daemon created) and unpinned after: the training side's retention still works."""
    local, volume = job_root(tmp_path), tmp_path / "volume"
    volume.mkdir()
    info = save(local, 1, {"model.pt": os.urandom(2000)})
    seen: dict[str, Any] = {}

    class Watching(VolumeDestination):
        def remote_manifest(self, name: str) -> Optional[bytes]:
            marker = info.path / UPLOADING_MARKER
            seen["pinned"] = marker.is_file() and not marker.is_symlink()
            seen["uid"] = os.lstat(marker).st_uid
            return super().remote_manifest(name)

    with uploading(local, Watching(volume)) as uploader:
        wait_for(lambda: state(uploader, info.name) == "done", timeout=20)
    assert seen == {"pinned": True, "uid": os.geteuid()}
    assert not os.path.lexists(info.path / UPLOADING_MARKER)


@needs_root
def test_stale_marker_cleanup_never_reads_through_a_link_nor_blocks_on_a_fifo(
    tmp_path: Path,
) -> None:
    """At start the uploader removes only the markers an earlier run wrote: a link to a
    file that reads like one is not followed (and stays), a FIFO does not hang the start."""
    local, volume = job_root(tmp_path), tmp_path / "volume"
    volume.mkdir()
    lookalike = tmp_path / "lookalike"
    lookalike.write_text("esi-sidecar uploader pid=1 since=0\n")
    linked = save(local, 1, {"a.bin": b"a" * 100}, plant={UPLOADING_MARKER: lookalike})
    fifo_save = save(local, 2, {"b.bin": b"b" * 100})
    os.mkfifo(fifo_save.path / UPLOADING_MARKER)
    leftover = save(local, 3, {"c.bin": b"c" * 100})
    (leftover.path / UPLOADING_MARKER).write_text("esi-sidecar uploader pid=1 since=0\n")

    config = UploaderConfig(root=local, location=None, scan_interval_seconds=0.1)
    uploader = Uploader(config, destination=VolumeDestination(volume))
    starting = threading.Thread(target=uploader.start, daemon=True)
    starting.start()
    starting.join(10)
    try:
        assert not starting.is_alive(), "start() blocked on a FIFO named .uploading"
    finally:
        if starting.is_alive():  # the old code: let it go so the test ends
            with open(fifo_save.path / UPLOADING_MARKER, "wb"):
                pass
            starting.join(5)
        uploader.stop(timeout=5)
    assert os.readlink(linked.path / UPLOADING_MARKER) == str(lookalike)
    assert lookalike.read_text() == "esi-sidecar uploader pid=1 since=0\n"
    assert not os.path.lexists(leftover.path / UPLOADING_MARKER)  # an earlier run's: gone


@needs_root
def test_a_fifo_named_latest_does_not_block_the_daemons_retention(tmp_path: Path) -> None:
    """``--upload-keep-local`` reads the job's ``latest`` pointer: without following a
    link, and a FIFO there does not hang the upload thread."""
    local, volume = job_root(tmp_path), tmp_path / "volume"
    volume.mkdir()
    first = save(local, 1, {"a.bin": b"a" * 100})
    second = save(local, 2, {"b.bin": b"b" * 100})
    (local / "latest").unlink()
    os.mkfifo(local / "latest")
    config = UploaderConfig(root=local, location=None, scan_interval_seconds=0.1,
                            keep_local=1)
    uploader = Uploader(config, destination=VolumeDestination(volume))
    uploader.start()
    try:
        wait_for(lambda: state(uploader, second.name) == "done"
                 and not first.path.exists(), timeout=20)
    finally:
        uploader.stop(timeout=5)
        if uploader.alive():  # the old code: blocked in open(); let it go
            with open(os.open(local / "latest", os.O_WRONLY | os.O_NONBLOCK), "wb"):
                pass


# --------------------------------------------- items 2 and 3: durable files, the marker


@needs_root
def test_a_pin_aimed_at_a_durable_checkpoint_leaves_it_byte_identical(tmp_path: Path) -> None:
    """Unchanged files are hard links across durable checkpoints on the volume: a pin
    aimed at one would cut both. It is never written; restore still works."""
    local, volume, fresh = job_root(tmp_path), tmp_path / "volume", tmp_path / "fresh"
    volume.mkdir()
    frozen = os.urandom(64 * 1024)
    with uploading(local, VolumeDestination(volume)) as uploader:
        first = save(local, 1, {"frozen.bin": frozen, "head.bin": os.urandom(100)})
        wait_for(lambda: state(uploader, first.name) == "done", timeout=20)
        second = save(local, 2, {"frozen.bin": frozen, "head.bin": os.urandom(100)})
        wait_for(lambda: state(uploader, second.name) == "done", timeout=20)
        shared = volume / first.name / "frozen.bin"
        assert os.stat(shared).st_ino == os.stat(volume / second.name / "frozen.bin").st_ino
        third = save(local, 3, {"frozen.bin": frozen, "head.bin": os.urandom(100)},
                     plant={UPLOADING_MARKER: shared})
        wait_for(lambda: state(uploader, third.name) == "done", timeout=20)
    for name in (first.name, second.name, third.name):
        assert (volume / name / "frozen.bin").read_bytes() == frozen
    result = restore(volume, fresh)
    assert result.returncode == 0, result.stderr
    assert (latest_valid(fresh, verify_checksums=True).path  # type: ignore[union-attr]
            / "frozen.bin").read_bytes() == frozen


@needs_root
def test_a_pin_aimed_at_the_volume_marker_does_not_stop_uploads(tmp_path: Path) -> None:
    local, volume = job_root(tmp_path), tmp_path / "volume"
    volume.mkdir()
    with uploading(local, VolumeDestination(volume)) as uploader:
        first = save(local, 1, {"model.pt": os.urandom(1000)})
        wait_for(lambda: state(uploader, first.name) == "done", timeout=20)
        marker = (volume / VOLUME_MARKER).read_bytes()
        second = save(local, 2, {"model.pt": os.urandom(1000)},
                      plant={UPLOADING_MARKER: volume / VOLUME_MARKER})
        settled(uploader, second.name)
        assert state(uploader, second.name) == "done", record(uploader, second.name)
        third = save(local, 3, {"model.pt": os.urandom(1000)})
        settled(uploader, third.name)
        assert state(uploader, third.name) == "done", record(uploader, third.name)
    assert (volume / VOLUME_MARKER).read_bytes() == marker


# -------------------------------------------- item 5: what the daemon reads of the job


@needs_root
def test_a_hard_link_to_a_root_only_file_is_never_uploaded(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    local, volume = job_root(tmp_path), tmp_path / "volume"
    volume.mkdir()
    secret = root_only(tmp_path / "token")
    caplog.set_level(logging.INFO, logger="sidecar.host.upload")
    with uploading(local, VolumeDestination(volume)) as uploader:
        good = save(local, 1, {"model.pt": os.urandom(1000)})
        wait_for(lambda: state(uploader, good.name) == "done", timeout=20)
        bad = save(local, 2, {"model.pt": os.urandom(1000)}, links={"token": secret})
        assert settled(uploader, bad.name) == "skipped"
        found = record(uploader, bad.name)
        assert found is not None and found.note is not None
        assert "not durable" in found.note and "hard links" in found.note
        assert f"{bad.name}/token" in found.note
        assert uploader.tracker.last_durable().step == 1  # type: ignore[union-attr]
    every = b"".join(p.read_bytes() for p in volume.rglob("*") if p.is_file())
    assert SECRET not in every
    assert not (volume / bad.name).exists()
    lines = [r.getMessage() for r in caplog.records if "is not durable" in r.getMessage()]
    assert len(lines) == 1 and bad.name in lines[0], lines


@needs_root
def test_a_hard_link_is_never_uploaded_to_s3(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("moto.server")
    from upload_support import isolate_aws_env, running_s3

    isolate_aws_env(monkeypatch)
    local = job_root(tmp_path)
    secret = root_only(tmp_path / "token")
    with running_s3() as s3:
        bucket = s3.bucket("hostile")
        config = UploaderConfig(root=local, location=bucket, storage=s3.storage(),
                                scan_interval_seconds=0.1, backoff_base_seconds=0.05,
                                backoff_cap_seconds=0.4)
        uploader = Uploader(config)
        uploader.start()
        try:
            bad = save(local, 2, {"model.pt": os.urandom(1000)}, links={"token": secret})
            assert settled(uploader, bad.name) == "skipped"
        finally:
            uploader.stop(timeout=5)
        assert s3.keys(bucket) == []
        assert s3.multipart_uploads(bucket) == []


@needs_root
def test_only_files_the_folder_owner_could_read_are_uploaded(tmp_path: Path) -> None:
    """One link each: a root-only file moved into the job's folder is refused; the job's
    own 0600 file and a root-owned world-readable file are read."""
    local, volume = job_root(tmp_path), tmp_path / "volume"
    volume.mkdir()
    with uploading(local, VolumeDestination(volume)) as uploader:
        checkpoint = atomic_checkpoint(local, 1, checksum=True)
        with checkpoint as folder:
            root_only(folder / "moved-in")
        refused = checkpoint.info
        assert refused is not None
        assert settled(uploader, refused.name) == "skipped"
        assert "uid 0" in (record(uploader, refused.name).note or "")  # type: ignore[union-attr]

        checkpoint = atomic_checkpoint(local, 2, checksum=True)
        with checkpoint as folder:
            own = root_only(folder / "own", b"the job's own")
            os.chown(own, JOB_UID, JOB_UID)
            (folder / "public").write_bytes(b"root's, readable by all")
            os.chmod(folder / "public", 0o644)
        accepted = checkpoint.info
        assert accepted is not None
        wait_for(lambda: state(uploader, accepted.name) == "done", timeout=20)
    assert (volume / accepted.name / "own").read_bytes() == b"the job's own"
    assert not (volume / refused.name).exists()


@needs_root
def test_a_symlinked_manifest_is_never_read(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    local, volume = job_root(tmp_path), tmp_path / "volume"
    volume.mkdir()
    info = save(local, 1, {"model.pt": os.urandom(100)})
    real = tmp_path / "elsewhere.json"
    os.rename(info.path / "MANIFEST.json", real)
    os.chmod(real, 0o600)
    os.symlink(real, info.path / "MANIFEST.json")
    caplog.set_level(logging.WARNING, logger="sidecar.host.upload")
    with uploading(local, VolumeDestination(volume)) as uploader:
        wait_for(lambda: state(uploader, info.name) == "done"
                 or any("not uploading" in r.getMessage() for r in caplog.records), timeout=20)
        assert state(uploader, info.name) is None
    line = next(r.getMessage() for r in caplog.records if "not uploading" in r.getMessage())
    assert "symbolic link" in line
    assert not (volume / info.name).exists()


# ------------------------------------------------------------------ smaller items


def test_a_file_name_with_a_newline_writes_one_log_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """A committed checkpoint whose listed file (named with a newline) is gone: the reason
    line names it escaped, and no forged line starts with CRITICAL."""
    local, volume = tmp_path / "local", tmp_path / "volume"
    local.mkdir()
    volume.mkdir()
    name = "x.bin\nCRITICAL sidecar: forged line"
    info = save(local, 1, {name: b"x" * 10})
    (info.path / name).unlink()
    caplog.set_level(logging.WARNING, logger="sidecar.host.upload")
    with uploading(local, VolumeDestination(volume)):
        wait_for(lambda: any("not uploading" in r.getMessage() for r in caplog.records),
                 timeout=20)
    line = next(r.getMessage() for r in caplog.records if "not uploading" in r.getMessage())
    assert "\n" not in line and "x.bin\\nCRITICAL" in line


@needs_root
def test_a_refused_file_is_named_escaped_in_the_status(tmp_path: Path) -> None:
    local, volume = job_root(tmp_path), tmp_path / "volume"
    volume.mkdir()
    secret = root_only(tmp_path / "token")
    with uploading(local, VolumeDestination(volume)) as uploader:
        bad = save(local, 1, {"model.pt": b"m" * 10},
                   links={"tok\x1b[2J\nCRITICAL en": secret})
        assert settled(uploader, bad.name) == "skipped"
        shown = uploader.tracker.get(bad.name).to_json(0.0)["note"]  # type: ignore[union-attr]
    assert "tok\\x1b[2J\\nCRITICAL en" in shown
    assert not any(ord(char) < 0x20 for char in shown)


def test_every_log_line_of_the_daemon_is_one_line(tmp_path: Path) -> None:
    """The daemon's handlers escape control characters in every message (``hold_back_
    repeats`` installs it): an argument cannot start a line of its own."""
    logger = logging.getLogger("test.hostile.lines")
    logger.propagate = False
    path = tmp_path / "log"
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    logger.addHandler(handler)
    hold_back_repeats(logger)
    try:
        logger.warning("uploaded %s", "a\nCRITICAL forged\r\x1b[2J\u2028b")
    finally:
        logger.removeHandler(handler)
        handler.close()
    text = path.read_text()
    assert text.count("\n") == 1 and "\u2028" not in text and "\x1b" not in text
    assert text.startswith("WARNING uploaded a\\nCRITICAL forged\\r\\x1b[2J\\u2028b")


def test_bytes_done_never_exceeds_bytes_total_while_a_file_is_sent_again() -> None:
    tracker = UploadTracker(source="local", destination="file:///v", endpoint=None)
    tracker.put(UploadRecord(name="step_1", step=1, created_at_unix=0.0, digest="d",
                             bytes_total=100, file_count=2))
    tracker.add_progress("step_1", 80)  # streamed while the save ran
    tracker.add_progress("step_1", 60)  # one file changed after: sent again
    found = tracker.get("step_1")
    assert found is not None and found.bytes_done == 100
    assert found.to_json(0.0)["bytes_done"] <= found.to_json(0.0)["bytes_total"]
    tracker.add_progress("step_1", -500)  # a rewound part never goes below zero
    assert tracker.get("step_1").bytes_done == 0  # type: ignore[union-attr]
