"""A torn read with the default save (no sha256 in the manifest): a file rewritten in
place, with the same size, while the uploader reads it is never committed as read (half
old bytes, half new). The sha256 at the commit cannot catch it, as the manifest has none;
the read itself must: the file's inode, size, mtime and ctime before and after the read
(``commit_check``), on both destinations (the volume's hidden folder; S3's multipart
uploads, on moto on loopback)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from upload_support import MIB, S3Server, isolate_aws_env, make_checkpoint

from sidecar.checkpoint.folders import latest_valid
from sidecar.checkpoint.manifest import MANIFEST_NAME, CheckpointInfo
from sidecar.host.upload.commit_check import StagingDestination
from sidecar.host.upload.storage import make_client
from sidecar.host.upload.transfer import S3Destination
from sidecar.host.upload.volume import VolumeDestination

SIZE = 9 * MIB  # read in parts (4 MiB on the volume, 5 MiB on S3): torn after the first


@pytest.fixture(autouse=True)
def _env(monkeypatch: pytest.MonkeyPatch) -> None:
    isolate_aws_env(monkeypatch)


def saved_by_default(root: Path) -> CheckpointInfo:
    """A checkpoint saved as ``atomic_checkpoint`` does by default: no sha256 recorded.
    Its file's mtime set an hour back, so that the rewrite moves it even when the save and
    the rewrite fall in one tick of the kernel's coarse file clock."""
    info = make_checkpoint(root, 1, {"model.pt": SIZE}, checksum=False)
    assert [entry.sha256 for entry in info.files] == [None]
    hour_ago = time.time_ns() - 3600 * 10**9
    os.utime(info.path / "model.pt", ns=(hour_ago, hour_ago))
    return info


def which(committed: bytes, old: bytes, new: bytes, at: int) -> str:
    """What was committed: the file as rewritten, as saved, torn at ``at``, or other."""
    return {new: "new", old: "old", old[:at] + new[at:]: "torn"}.get(committed, "other")


def upload_rewriting_once(destination: StagingDestination, info: CheckpointInfo,
                          new: bytes) -> list[int]:
    """Upload ``info``, rewriting model.pt in place (same size) once the first part was
    read; returns how many bytes had been read then."""
    read = 0
    rewritten_at: list[int] = []

    def on_progress(count: int) -> None:
        nonlocal read
        read += count
        if count > 0 and not rewritten_at:
            with open(info.path / "model.pt", "r+b") as handle:  # in place: no new inode
                handle.write(new)
            rewritten_at.append(read)

    destination.upload(info, (info.path / MANIFEST_NAME).read_bytes(), on_progress=on_progress,
                       should_stop=lambda: None, before_manifest=lambda: None)
    return rewritten_at


def test_a_torn_read_to_the_volume_is_never_committed(tmp_path: Path) -> None:
    volume = tmp_path / "volume"
    volume.mkdir()
    info = saved_by_default(tmp_path / "local")
    old, new = (info.path / "model.pt").read_bytes(), os.urandom(SIZE)
    rewritten_at = upload_rewriting_once(VolumeDestination(volume), info, new)
    assert rewritten_at and 0 < rewritten_at[0] < SIZE  # mid-read
    committed = (volume / info.name / "model.pt").read_bytes()
    assert which(committed, old, new, rewritten_at[0]) == "new"  # read again, whole
    assert latest_valid(volume).step == 1  # type: ignore[union-attr]


def test_a_torn_read_to_s3_is_never_committed(s3: S3Server, tmp_path: Path) -> None:
    location = s3.bucket("torn-" + os.urandom(4).hex())
    info = saved_by_default(tmp_path / "local")
    old, new = (info.path / "model.pt").read_bytes(), os.urandom(SIZE)
    # One part in flight at a time: the second part is read after the first was sent.
    destination = S3Destination(s3.storage(concurrency=1), location, make_client)
    rewritten_at = upload_rewriting_once(destination, info, new)
    assert rewritten_at and 0 < rewritten_at[0] < SIZE  # mid-read
    committed = s3.get(location, location.key(info.name, "model.pt"))
    assert which(committed, old, new, rewritten_at[0]) == "new"  # read again, whole
