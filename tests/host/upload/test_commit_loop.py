"""The commit check's loop (commit_check.complete, reuse, mismatch) driven directly.

The volume and S3 destinations run this loop behind their staging places and have tests
of their own against a real folder and the S3 test server; these drive the loop through
a staging place that keeps what it is sent in memory and records every call, so that
each rule of the loop is reached in this process (the mutation check found them reached
only on the way by whole-daemon tests, docs/mutation.md): files not listed are dropped,
a file staged early and unchanged is kept, one that changed goes again with one line,
one that keeps changing stops the commit after ``COPY_ATTEMPTS`` reads, and an unchanged
file is copied from an equal durable one instead of sent."""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path
from typing import Callable, Optional

import pytest

from sidecar.checkpoint.folders import atomic_checkpoint
from sidecar.checkpoint.manifest import (
    MANIFEST_NAME,
    CheckpointInfo,
    FileEntry,
    Invalid,
    read_manifest,
)
from sidecar.host.upload.commit_check import (
    COPY_ATTEMPTS,
    DurableFile,
    StagedFile,
    complete,
    current_key,
    hash_file,
    mismatch,
)
from sidecar.host.upload.jobfiles import open_job_file


class MemoryStaging:
    """A staging place in memory: each call recorded as (what, path)."""

    def __init__(self, copy_fails: bool = False,
                 after_send: Optional[Callable[[str], None]] = None) -> None:
        self.files: dict[str, StagedFile] = {}
        self.calls: list[tuple[str, str]] = []
        self.copy_fails = copy_fails
        self.after_send = after_send or (lambda relative: None)

    def send(self, folder: Path, relative: str, *, on_progress: Callable[[int], None],
             should_stop: Callable[[], Optional[str]]) -> Optional[StagedFile]:
        self.calls.append(("send", relative))
        handle = open_job_file(folder, relative)
        try:
            digest, before, after = hash_file(handle)
        finally:
            os.close(handle)
        self.after_send(relative)
        if before != after:
            return None
        staged = StagedFile(relative, after[1], digest, after)
        self.files[relative] = staged
        return staged

    def copy(self, relative: str, durable: DurableFile, key: tuple[int, int, int, int]
             ) -> Optional[StagedFile]:
        self.calls.append(("copy", relative))
        if self.copy_fails:
            return None
        staged = StagedFile(relative, durable.size, durable.sha256, key, durable.checkpoint)
        self.files[relative] = staged
        return staged

    def drop(self, relative: str) -> None:
        self.calls.append(("drop", relative))
        self.files.pop(relative, None)

    def finish(self, info: CheckpointInfo, manifest: bytes) -> None:
        self.calls.append(("finish", info.name))

    def discard(self) -> None:
        self.calls.append(("discard", ""))


def save(root: Path, files: dict[str, bytes], checksum: bool = True) -> CheckpointInfo:
    saving = atomic_checkpoint(root, 1, checksum=checksum)
    with saving as folder:
        for name, data in files.items():
            (folder / name).write_bytes(data)
    return read_manifest(root / saving.name)


def commit(staging: MemoryStaging, info: CheckpointInfo,
           durable: Optional[dict[str, DurableFile]] = None) -> list[str]:
    order: list[str] = []
    complete(staging, info, (info.path / MANIFEST_NAME).read_bytes(), durable=durable or {},
             on_progress=lambda count: None, should_stop=lambda: None,
             before_manifest=lambda: order.append("before_manifest"))
    return order


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def rewrite_same_size(path: Path, data: bytes) -> None:
    """New bytes of the same size, with a new mtime and ctime (as a job's rewrite)."""
    before = os.stat(path)
    path.write_bytes(data)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns + 1_000_000))


def test_files_staged_early_and_unchanged_are_kept_and_unlisted_ones_dropped(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    info = save(tmp_path, {"a.bin": b"a" * 10, "b.bin": b"b" * 20})
    staging = MemoryStaging()
    for name in ("a.bin", "b.bin"):
        staging.send(info.path, name, on_progress=lambda c: None, should_stop=lambda: None)
    staging.files["stale.bin"] = StagedFile("stale.bin", 1, sha(b"x"), (0, 1, 0, 0))
    staging.calls.clear()
    with caplog.at_level(logging.INFO, "sidecar.host.upload.commit"):
        order = commit(staging, info)
    assert staging.calls == [("drop", "stale.bin"), ("finish", info.name)]
    assert set(staging.files) == {"a.bin", "b.bin"} and order == ["before_manifest"]
    assert caplog.records == []


def test_a_file_changed_after_it_was_sent_goes_again_with_one_line_and_a_new_one_quietly(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    info = save(tmp_path, {"a.bin": b"a" * 10, "new.bin": b"n" * 5}, checksum=False)
    staging = MemoryStaging()
    staging.send(info.path, "a.bin", on_progress=lambda c: None, should_stop=lambda: None)
    rewrite_same_size(info.path / "a.bin", b"A" * 10)
    staging.calls.clear()
    with caplog.at_level(logging.INFO, "sidecar.host.upload.commit"):
        commit(staging, info)
    assert staging.calls == [("drop", "a.bin"), ("send", "a.bin"), ("drop", "new.bin"),
                             ("send", "new.bin"), ("finish", info.name)]
    assert [r.getMessage() for r in caplog.records] == [
        f"{info.name}/a.bin goes again: changed after it was sent"]
    assert staging.files["a.bin"].sha256 == sha(b"A" * 10)


def test_a_file_that_keeps_changing_stops_the_commit_after_its_reads(tmp_path: Path) -> None:
    info = save(tmp_path, {"a.bin": b"a" * 10}, checksum=False)
    path = info.path / "a.bin"
    staging = MemoryStaging(after_send=lambda relative: rewrite_same_size(path, os.urandom(10)))
    with pytest.raises(Invalid) as refused:
        commit(staging, info)
    assert str(refused.value) == (f"file a.bin does not match its manifest in {COPY_ATTEMPTS} "
                                  "reads (changed after it was sent): changed after the save?")
    assert [c for c in staging.calls if c[0] == "send"] == [("send", "a.bin")] * COPY_ATTEMPTS
    assert ("finish", info.name) not in staging.calls


def test_an_unchanged_file_is_copied_from_an_equal_durable_one_without_its_bytes(
        tmp_path: Path) -> None:
    for checksum in (True, False):  # the manifest's sha256, or one local read
        root = tmp_path / str(checksum)
        info = save(root, {"frozen.bin": b"f" * 64, "model.bin": b"m" * 8}, checksum=checksum)
        durable = {"frozen.bin": DurableFile("step_00000000", 64, sha(b"f" * 64)),
                   "model.bin": DurableFile("step_00000000", 8, sha(b"other..."))}
        staging = MemoryStaging()
        commit(staging, info, durable)
        assert staging.calls == [("drop", "frozen.bin"), ("copy", "frozen.bin"),
                                 ("drop", "model.bin"), ("send", "model.bin"),
                                 ("finish", info.name)], checksum
        assert staging.files["frozen.bin"].stored_in == "step_00000000"


def test_the_manifests_sha256_decides_reuse_not_a_rewrite_after_the_save(
        tmp_path: Path) -> None:
    """The manifest says the file is the durable one's bytes: those are what the
    checkpoint must hold, so they are copied, whatever the job wrote over it since."""
    info = save(tmp_path, {"frozen.bin": b"f" * 64})
    rewrite_same_size(info.path / "frozen.bin", b"g" * 64)
    staging = MemoryStaging()
    commit(staging, info, {"frozen.bin": DurableFile("step_00000000", 64, sha(b"f" * 64))})
    assert ("copy", "frozen.bin") in staging.calls and ("send", "frozen.bin") not in staging.calls


def test_a_failed_server_side_copy_is_said_and_the_bytes_sent(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    info = save(tmp_path, {"frozen.bin": b"f" * 64})
    staging = MemoryStaging(copy_fails=True)
    with caplog.at_level(logging.INFO, "sidecar.host.upload.commit"):
        commit(staging, info, {"frozen.bin": DurableFile("step_00000000", 64, sha(b"f" * 64))})
    assert staging.calls == [("drop", "frozen.bin"), ("copy", "frozen.bin"),
                             ("send", "frozen.bin"), ("finish", info.name)]
    assert [r.getMessage() for r in caplog.records] == [
        "the server-side copy of frozen.bin from step_00000000 failed; sending its bytes"]


def test_each_reason_a_staged_copy_cannot_be_committed(tmp_path: Path) -> None:
    (tmp_path / "a.bin").write_bytes(b"a" * 10)
    key = current_key(tmp_path, "a.bin")
    assert key is not None
    entry = FileEntry("a.bin", 10, sha(b"a" * 10))
    good = StagedFile("a.bin", 10, sha(b"a" * 10), key)
    assert mismatch(entry, good, key) is None
    assert mismatch(FileEntry("a.bin", 10), good, key) is None  # no sha256 recorded
    assert mismatch(entry, None, key) == "not sent yet"
    assert mismatch(entry, good, None) == "the local file is gone"
    assert mismatch(entry, good, (key[0], 10, key[2] + 1, key[3])) == "changed after it was sent"
    assert mismatch(entry, StagedFile("a.bin", 9, good.sha256, key), key) == (
        "9 bytes sent, the manifest says 10")
    assert mismatch(entry, StagedFile("a.bin", 10, sha(b"b"), key), key) == (
        "its sha256 differs from the manifest's")
    (tmp_path / "a.bin").unlink()
    assert current_key(tmp_path, "a.bin") is None
