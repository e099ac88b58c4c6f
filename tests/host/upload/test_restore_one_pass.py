"""Restore verified in one pass (issue 40, item 1): files and ranges of a file copied in
parallel, each byte hashed as it is written; a byte flipped in the middle of a large file
is still refused, from a volume and from S3 (moto on loopback), with and without ranges,
the previous valid checkpoint is restored instead, and nothing appears under a
checkpoint's name before it is complete."""

from __future__ import annotations

import hashlib
import logging
import os
import random
import threading
import time
from dataclasses import asdict
from pathlib import Path

import pytest
from upload_support import MIB, S3Server, commit_to_s3, isolate_aws_env, make_checkpoint

from sidecar.checkpoint.folders import latest_valid
from sidecar.checkpoint.manifest import FileEntry, Invalid
from sidecar.host.upload import verified_copy
from sidecar.host.upload.fetch import restore_named, restore_newest
from sidecar.host.upload.restore import restore
from sidecar.host.upload.verified_copy import FolderSource, InOrderHash, Sink, copy_verified
from sidecar.host.upload.volume import RestoreError, copy_checkpoint

SMALL_RANGE = 64 * 1024  # a 1 MiB file: 16 ranges


@pytest.fixture(autouse=True)
def _env(monkeypatch: pytest.MonkeyPatch) -> None:
    isolate_aws_env(monkeypatch)
    monkeypatch.setattr(verified_copy, "REORDER_LIMIT", 4 * SMALL_RANGE)  # reached here


def flip_middle_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.chmod(0o644)
    path.write_bytes(bytes(data))


def visible(root: Path) -> list[str]:
    """What a reader of ``root`` takes for checkpoints: every name not hidden."""
    return sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) \
        if root.is_dir() else []


def test_the_hash_of_pieces_fed_out_of_order_from_threads_is_the_file_sha256() -> None:
    data = os.urandom(3 * MIB + 17)
    piece = 64 * 1024
    ranges = [(start, data[start:start + 4 * piece])
              for start in range(0, len(data), 4 * piece)]
    random.Random(7).shuffle(ranges)  # later ranges start first: they wait at the bound
    hashed = InOrderHash(limit=2 * piece)

    def deliver(start: int, chunk: bytes) -> None:
        for at in range(0, len(chunk), piece):
            hashed.feed(start + at, chunk[at:at + piece])

    threads = [threading.Thread(target=deliver, args=item) for item in ranges]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not any(thread.is_alive() for thread in threads)
    assert hashed.hexdigest(len(data)) == hashlib.sha256(data).hexdigest()


def test_the_ranges_of_one_file_are_copied_at_the_same_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(verified_copy, "RANGE_SIZE", SMALL_RANGE)
    info = make_checkpoint(tmp_path / "local", 1, {"model.pt": 2 * SMALL_RANGE})
    both_in_flight = threading.Barrier(2, timeout=20)  # broken unless two ranges overlap

    class Meeting(FolderSource):
        def read(self, entry: FileEntry, offset: int, length: int, sink: Sink) -> None:
            both_in_flight.wait()
            super().read(entry, offset, length, sink)

    into = tmp_path / "into"
    into.mkdir()
    copy_verified(Meeting(info.path), info.files, into, workers=2)
    assert (into / "model.pt").read_bytes() == (info.path / "model.pt").read_bytes()


def test_a_folder_under_the_target_that_is_a_link_is_not_followed(tmp_path: Path) -> None:
    info = make_checkpoint(tmp_path / "local", 1, {"dcp/shard_0.distcp": 1000})
    into, elsewhere = tmp_path / "into", tmp_path / "elsewhere"
    into.mkdir()
    elsewhere.mkdir()
    (into / "dcp").symlink_to(elsewhere)  # put there before the copy
    with pytest.raises(OSError):
        copy_verified(FolderSource(info.path), info.files, into)
    assert list(elsewhere.iterdir()) == []


@pytest.mark.parametrize("range_size", [SMALL_RANGE, 64 * MIB], ids=["ranges", "whole-files"])
def test_a_flipped_byte_on_the_volume_falls_back_to_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
    range_size: int,
) -> None:
    monkeypatch.setattr(verified_copy, "RANGE_SIZE", range_size)
    volume, local, fresh = tmp_path / "volume", tmp_path / "local", tmp_path / "fresh"
    volume.mkdir()
    sizes = {"model.pt": MIB, "optim/state.pt": MIB // 2 + 3, "rng.json": 40}
    for step in (1, 2):
        info = make_checkpoint(local, step, sizes)
        copy_checkpoint(info, (info.path / "MANIFEST.json").read_bytes(), volume)
    flip_middle_byte(volume / "step_00000002" / "model.pt")
    with caplog.at_level(logging.WARNING):
        restored = restore_newest(volume.as_uri(), fresh, {})
    assert restored.info.step == 1
    assert "skipping" in caplog.text and "model.pt does not match its sha256" in caplog.text
    assert visible(fresh) == ["latest", "step_00000001"]  # no step 2, no leftover
    assert [p.name for p in fresh.iterdir() if p.name.startswith(".")] == []
    found = latest_valid(fresh, verify_checksums=True, clean=False)
    assert found is not None and found.step == 1


@pytest.mark.parametrize("range_size", [SMALL_RANGE, 64 * MIB], ids=["ranges", "whole-files"])
def test_a_flipped_byte_in_s3_falls_back_and_nothing_shows_before_it_is_complete(
    s3: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture, range_size: int,
) -> None:
    monkeypatch.setattr(verified_copy, "RANGE_SIZE", range_size)
    location = s3.bucket("flip-" + os.urandom(4).hex())
    sizes = {"model.pt": MIB, "optim/state.pt": MIB // 2 + 3, "empty.bin": 0}
    for step in (1, 2):
        commit_to_s3(s3, location, make_checkpoint(tmp_path / "local", step, sizes))
    key = location.key("step_00000002", "model.pt")
    data = bytearray(s3.get(location, key))
    data[len(data) // 2] ^= 0xFF
    s3.client().put_object(Bucket=location.bucket, Key=key, Body=bytes(data))
    fresh = tmp_path / "fresh"
    seen: list[list[str]] = []  # what a reader sees at each piece, from the copy's threads
    with caplog.at_level(logging.WARNING):
        restored = restore(s3.storage(), location, fresh,
                           on_progress=lambda count: seen.append(visible(fresh)))
    assert restored.info.step == 1
    assert "skipping" in caplog.text and "model.pt does not match its sha256" in caplog.text
    assert seen and all(names == [] for names in seen)  # nothing before it was complete
    assert visible(fresh) == ["latest", "step_00000001"]
    found = latest_valid(fresh, verify_checksums=True, clean=False)
    assert found is not None and found.step == 1
    # Asked for by name (the follower's call): refused, nothing left.
    with pytest.raises(RestoreError, match=r"model\.pt does not match its sha256"):
        restore_named(location.url, "step_00000002", tmp_path / "named", asdict(s3.storage()))
    assert visible(tmp_path / "named") == []


def test_restore_named_from_a_volume_brings_that_checkpoint_and_is_idempotent(
    tmp_path: Path,
) -> None:
    volume = tmp_path / "volume"
    volume.mkdir()
    for step in (1, 2):
        info = make_checkpoint(tmp_path / "local", step, {"w.bin": 3000})
        copy_checkpoint(info, (info.path / "MANIFEST.json").read_bytes(), volume)
    first = restore_named(volume.as_uri(), "step_00000001", tmp_path / "fresh", {})
    assert first.info.step == 1 and not first.already_present
    again = restore_named(volume.as_uri(), "step_00000001", tmp_path / "fresh", {})
    assert again.already_present
    with pytest.raises(RestoreError, match="not a complete checkpoint"):
        restore_named(volume.as_uri(), "step_00000009", tmp_path / "fresh", {})


def test_a_file_that_changes_size_is_refused_with_both_sizes(tmp_path: Path) -> None:
    info = make_checkpoint(tmp_path / "local", 1, {"w.bin": 5000})
    (info.path / "w.bin").chmod(0o644)
    (info.path / "w.bin").write_bytes(b"short")
    into = tmp_path / "into"
    into.mkdir()
    with pytest.raises(Invalid, match="is 5 bytes, the manifest says 5000"):
        copy_verified(FolderSource(info.path), info.files, into)


def test_the_bandwidth_cap_holds_for_all_the_ranged_gets_together(
    s3: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(verified_copy, "RANGE_SIZE", SMALL_RANGE)
    location = s3.bucket("cap-" + os.urandom(4).hex())
    commit_to_s3(s3, location, make_checkpoint(tmp_path / "local", 1,
                                               {"a.bin": 3 * MIB // 2, "b.bin": 3 * MIB // 2}))
    started = time.monotonic()
    restore(s3.storage(max_bandwidth=2 * MIB, concurrency=4), location, tmp_path / "fresh")
    assert time.monotonic() - started >= 3 / 2 * 0.8  # 3 MiB at 2 MiB/s, 4 GETs at once


def test_a_path_that_leaves_the_target_is_refused(tmp_path: Path) -> None:
    into = tmp_path / "deep" / "into"
    into.mkdir(parents=True)
    entry = FileEntry("../escaped.bin", 3, None)
    with pytest.raises(Invalid, match="unsafe path"):
        copy_verified(FolderSource(tmp_path), [entry], into)
    assert not (tmp_path / "deep" / "escaped.bin").exists()
