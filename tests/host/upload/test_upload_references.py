"""An unchanged file on S3 by reference (``s3_refs``), on a real S3-protocol server
(moto on loopback): the new checkpoint is durable without its bytes moving, restore
reads the file from the folder that holds it, the server-side copy that makes the folder
self-contained again can stop midway and leaves the references valid, and a malformed
references object gets a clear error instead of a wrong checkpoint."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from upload_support import MIB, S3Server, commit_to_s3, isolate_aws_env, wait_for

from sidecar.checkpoint.folders import CheckpointInfo, atomic_checkpoint, latest_valid
from sidecar.host.upload import s3_refs
from sidecar.host.upload.location import S3Location
from sidecar.host.upload.restore import restore
from sidecar.host.upload.s3_refs import REFERENCES_NAME, read_references
from sidecar.host.upload.uploader import Uploader, UploaderConfig
from sidecar.host.upload.volume import Cancelled, RestoreError


@pytest.fixture(autouse=True)
def _env(monkeypatch: pytest.MonkeyPatch) -> None:
    isolate_aws_env(monkeypatch)


def save(root: Path, step: int, files: dict[str, bytes]) -> CheckpointInfo:
    writer = atomic_checkpoint(root, step, checksum=True)
    with writer as folder:
        for relative, data in files.items():
            (folder / relative).write_bytes(data)
    assert writer.info is not None
    return writer.info


def restored(s3: S3Server, location: S3Location, root: Path) -> dict[str, bytes]:
    result = restore(s3.storage(), location, root)
    info = latest_valid(root, verify_checksums=True, clean=False)
    assert info is not None and info.name == result.info.name
    return {entry.path: (info.path / entry.path).read_bytes() for entry in info.files}


def two_checkpoints(s3: S3Server, tmp_path: Path, frozen: bytes) -> tuple[S3Location, bytes]:
    """step 1 (frozen + weights), then step 2 with the same frozen file, by reference."""
    location = s3.bucket("refs-" + os.urandom(4).hex())
    local = tmp_path / "local"
    commit_to_s3(s3, location, save(local, 1, {"frozen.bin": frozen, "w.bin": os.urandom(MIB)}))
    weights = os.urandom(MIB)
    commit_to_s3(s3, location, save(local, 2, {"frozen.bin": frozen, "w.bin": weights}),
                 unchanged_since="step_00000001")
    return location, weights


def test_restore_reads_a_referenced_file_from_the_folder_that_holds_it(
    s3: S3Server, tmp_path: Path
) -> None:
    frozen = os.urandom(6 * MIB)
    location, weights = two_checkpoints(s3, tmp_path, frozen)
    keys = s3.keys(location)
    assert location.key("step_00000002", "frozen.bin") not in keys  # no byte moved
    assert read_references(s3.client(), location, "step_00000002") == {
        "frozen.bin": "step_00000001"}
    assert restored(s3, location, tmp_path / "fresh") == {"frozen.bin": frozen, "w.bin": weights}


def test_a_self_contain_that_stops_midway_leaves_valid_references(
    s3: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(s3_refs, "COPY_PART_SIZE", 5 * MIB)  # S3's smallest copy part
    frozen = os.urandom(12 * MIB)  # three parts
    location, weights = two_checkpoints(s3, tmp_path, frozen)
    client = s3.client()
    asked = []

    def stop_at_the_second_part() -> str | None:
        asked.append(1)
        return "a checkpoint was saved" if len(asked) == 2 else None

    with pytest.raises(Cancelled):
        s3_refs.materialize(client, location, "step_00000002", stop_at_the_second_part)
    assert s3.multipart_uploads(location) == []
    assert location.key("step_00000002", "frozen.bin") not in s3.keys(location)
    assert restored(s3, location, tmp_path / "a") == {"frozen.bin": frozen, "w.bin": weights}

    assert s3_refs.materialize(client, location, "step_00000002", lambda: None) == 1
    keys = s3.keys(location)
    assert location.key("step_00000002", REFERENCES_NAME) not in keys
    # Self-contained: step 1 may go, by hand or by a lifecycle rule.
    for key in [k for k in keys if "/step_00000001/" in k]:
        client.delete_object(Bucket=location.bucket, Key=key)
    assert restored(s3, location, tmp_path / "b") == {"frozen.bin": frozen, "w.bin": weights}


def test_a_re_save_under_the_same_name_drops_the_stale_references(
    s3: S3Server, tmp_path: Path
) -> None:
    location, _ = two_checkpoints(s3, tmp_path, os.urandom(6 * MIB))
    other = tmp_path / "other"
    again = {"frozen.bin": os.urandom(6 * MIB), "w.bin": os.urandom(MIB)}
    commit_to_s3(s3, location, save(other, 2, again))
    assert read_references(s3.client(), location, "step_00000002") == {}
    assert restored(s3, location, tmp_path / "fresh") == again


@pytest.mark.parametrize("body, why", [
    (b"{not json", "is not JSON"),
    (b'{"format": 1, "files": {"frozen.bin": "../elsewhere"}}', "unsafe folder"),
    (b'{"format": 7, "files": {}}', "no format 1"),
])
def test_malformed_references_stop_the_restore_with_the_reason(
    s3: S3Server, tmp_path: Path, body: bytes, why: str
) -> None:
    location, _ = two_checkpoints(s3, tmp_path, os.urandom(MIB))
    s3.client().put_object(Bucket=location.bucket,
                           Key=location.key("step_00000002", REFERENCES_NAME), Body=body)
    target = tmp_path / "fresh"
    with pytest.raises(RestoreError, match=why):
        restore(s3.storage(), location, target)
    assert latest_valid(target, clean=False) is None  # nothing half-restored


def test_a_restarted_uploader_makes_the_newest_durable_checkpoint_self_contained(
    s3: S3Server, tmp_path: Path
) -> None:
    """A daemon killed between the commit and the copy: the next one finds the newest
    checkpoint durable already, with references, and copies them in."""
    frozen = os.urandom(6 * MIB)
    location, _ = two_checkpoints(s3, tmp_path, frozen)
    config = UploaderConfig(root=tmp_path / "local", location=location, storage=s3.storage(),
                            scan_interval_seconds=0.2, settle_seconds=0.2, probe=False)
    uploader = Uploader(config)
    own = location.key("step_00000002", "frozen.bin")
    refs = location.key("step_00000002", REFERENCES_NAME)
    uploader.start()
    try:
        wait_for(lambda: own in s3.keys(location) and refs not in s3.keys(location),
                 timeout=20)
        record = uploader.tracker.get("step_00000002")
        assert record is not None and record.note == "already complete in storage"
    finally:
        uploader.stop(timeout=5)
    assert s3.get(location, own) == frozen
