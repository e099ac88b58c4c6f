"""The uploader against a real S3-protocol server on loopback (moto's standalone server,
over HTTP, with the real boto3): multipart, manifest last, newest first, yielding near the
release, the .uploading pin, storage down and back, restarts.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
from botocore.exceptions import ClientError
from upload_support import (
    MIB,
    S3Server,
    isolate_aws_env,
    make_checkpoint,
    running_s3,
    wait_for,
)

from sidecar.checkpoint.folders import list_checkpoints, prune
from sidecar.host.upload import transfer
from sidecar.host.upload.location import S3Location
from sidecar.host.upload.uploader import MARKER_NAME, Uploader, UploaderConfig


@pytest.fixture(autouse=True)
def _env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    isolate_aws_env(monkeypatch)
    yield
    transfer._phase_hook = None


def start_uploader(
    s3: S3Server, root: Path, location: S3Location, *,
    remaining: Callable[[], Optional[float]] = lambda: None, **options: Any,
) -> Uploader:
    storage = s3.storage(**options.pop("storage", {}))
    options.setdefault("scan_interval_seconds", 0.2)
    config = UploaderConfig(root=root, location=location, storage=storage,
                            backoff_base_seconds=0.05, backoff_cap_seconds=0.3, **options)
    uploader = Uploader(config, remaining_seconds=remaining)
    uploader.start()
    return uploader


def state(uploader: Uploader, name: str) -> Optional[str]:
    record = uploader.tracker.get(name)
    return record.state if record else None


def test_multipart_upload_with_the_manifest_written_last(
    s3: S3Server, bucket: S3Location, tmp_path: Path
) -> None:
    info = make_checkpoint(tmp_path, 100, {"model.pt": 12 * MIB + 7, "optim/state.pt": MIB,
                                            "config.json": 20, "empty": 0})
    files = {bucket.key(info.name, entry.path) for entry in info.files}
    manifest = bucket.manifest_key(info.name)
    # Watch the server from outside while the upload runs: every listing that shows the
    # manifest must show every file too.
    snapshots: list[list[str]] = []
    done = threading.Event()

    def watch_server() -> None:
        while not done.is_set():
            snapshots.append(s3.keys(bucket))

    watcher = threading.Thread(target=watch_server)
    watcher.start()
    uploader = start_uploader(s3, tmp_path, bucket)
    try:
        wait_for(lambda: state(uploader, info.name) == "done", timeout=20)
    finally:
        uploader.stop()
        done.set()
        watcher.join()
    keys = s3.keys(bucket)
    assert set(keys) == files | {manifest}
    assert all(files <= set(seen) for seen in snapshots if manifest in seen)
    # 12 MiB in 5 MiB parts: a multipart object of three parts (its ETag says so).
    head = s3.client().head_object(Bucket=bucket.bucket, Key=bucket.key(info.name, "model.pt"))
    assert head["ETag"].strip('"').endswith("-3")
    assert head["ContentLength"] == 12 * MIB + 7
    assert s3.get(bucket, manifest) == (info.path / "MANIFEST.json").read_bytes()
    for entry in info.files:
        assert s3.get(bucket, bucket.key(info.name, entry.path)) == (
            info.path / entry.path).read_bytes()
    record = uploader.tracker.get(info.name)
    assert record is not None and record.bytes_done == record.bytes_total == info.total_bytes
    assert uploader.tracker.last_durable() == record
    assert not (info.path / MARKER_NAME).exists()


def test_the_manifest_waits_for_every_file(
    s3: S3Server, bucket: S3Location, tmp_path: Path
) -> None:
    """The same ordering seen from inside: at the last step before the manifest, every
    file is on the server and the manifest is not."""
    info = make_checkpoint(tmp_path, 7, {"a.bin": 6 * MIB, "b.bin": 10})
    seen: dict[str, list[str]] = {}
    transfer._phase_hook = lambda phase, detail: (
        seen.setdefault(phase, s3.keys(bucket)) if phase in ("sizes-verified",
                                                             "manifest-written") else None)
    uploader = start_uploader(s3, tmp_path, bucket)
    try:
        wait_for(lambda: state(uploader, info.name) == "done", timeout=20)
    finally:
        uploader.stop()
    manifest = bucket.manifest_key(info.name)
    assert manifest not in seen["sizes-verified"]
    assert set(seen["sizes-verified"]) == {bucket.key(info.name, "a.bin"),
                                           bucket.key(info.name, "b.bin")}
    assert manifest in seen["manifest-written"]


def test_newest_first_and_older_ones_skipped_once_a_newer_is_durable(
    s3: S3Server, bucket: S3Location, tmp_path: Path
) -> None:
    for step in (1, 2, 3):
        make_checkpoint(tmp_path, step, {"w.bin": 1000 + step})
    uploader = start_uploader(s3, tmp_path, bucket)
    try:
        wait_for(lambda: state(uploader, "step_00000003") == "done", timeout=20)
        wait_for(lambda: state(uploader, "step_00000001") == "skipped")
        # A newer checkpoint appearing later is picked up (inotify or the rescan).
        make_checkpoint(tmp_path, 4, {"w.bin": 5000})
        wait_for(lambda: state(uploader, "step_00000004") == "done", timeout=20)
    finally:
        uploader.stop()
    record = uploader.tracker.get("step_00000002")
    assert record is not None and record.state == "skipped" and "superseded" in (record.note or "")
    assert [key for key in s3.keys(bucket) if key.endswith("MANIFEST.json")] == [
        bucket.manifest_key("step_00000003"), bucket.manifest_key("step_00000004")]
    assert uploader.tracker.last_durable().step == 4  # type: ignore[union-attr]
    # Nothing was deleted locally.
    assert [listing.step for listing in list_checkpoints(tmp_path)] == [4, 3, 2, 1]


def test_near_the_release_an_older_upload_yields_to_the_newest(
    s3: S3Server, bucket: S3Location, tmp_path: Path
) -> None:
    make_checkpoint(tmp_path, 1, {"big.bin": 12 * MIB})
    released = threading.Event()
    created = threading.Event()

    def hook(phase: str, detail: Any) -> None:
        if phase == "progress" and not created.is_set():
            # Mid-upload of step 1: the trainer commits step 2; hold this transfer until
            # the uploader decides to yield (it does so without waiting for us).
            created.set()
            make_checkpoint(tmp_path, 2, {"big.bin": 2 * MIB})
            uploader.wake()
            released.wait(10)
        elif phase == "cancelling":
            released.set()

    transfer._phase_hook = hook
    uploader = start_uploader(s3, tmp_path, bucket, remaining=lambda: 120.0,
                              storage={"concurrency": 1})
    try:
        wait_for(lambda: state(uploader, "step_00000002") == "done", timeout=20)
        wait_for(lambda: state(uploader, "step_00000001") == "skipped")
    finally:
        released.set()
        uploader.stop()
    assert released.is_set()
    manifests = [key for key in s3.keys(bucket) if key.endswith("MANIFEST.json")]
    assert manifests == [bucket.manifest_key("step_00000002")]
    # The abandoned multipart upload of step 1 was aborted, not left behind.
    assert s3.multipart_uploads(bucket) == []
    assert uploader.tracker.get("step_00000001").attempts == 1  # type: ignore[union-attr]


def test_near_the_release_an_upload_that_leaves_time_for_the_newer_one_is_finished_first(
    s3: S3Server, bucket: S3Location, tmp_path: Path
) -> None:
    """The final checkpoint, then the top-up save after it: when both uploads still end
    before the release (at the known throughput, here the cap), the one in progress is
    not given up for the newer one, so the final checkpoint is durable in any case."""
    make_checkpoint(tmp_path, 1, {"big.bin": 12 * MIB})
    phases: list[str] = []

    def hook(phase: str, detail: Any) -> None:
        phases.append(phase)
        if phase == "progress" and not (tmp_path / "step_00000002").exists():
            make_checkpoint(tmp_path, 2, {"big.bin": 2 * MIB})
            uploader.wake()

    transfer._phase_hook = hook
    # 40 MiB/s cap: 14 MiB x 1.2 take 0.42 s, far less than the 120 s left.
    uploader = start_uploader(s3, tmp_path, bucket, remaining=lambda: 120.0,
                              storage={"concurrency": 1, "max_bandwidth": 40 * MIB})
    try:
        wait_for(lambda: state(uploader, "step_00000002") == "done", timeout=20)
    finally:
        uploader.stop()
    assert "cancelling" not in phases
    first = uploader.tracker.get("step_00000001")
    assert first is not None and first.state == "done" and first.attempts == 1
    manifests = [key for key in s3.keys(bucket) if key.endswith("MANIFEST.json")]
    assert manifests == [bucket.manifest_key("step_00000001"), bucket.manifest_key("step_00000002")]


def test_uploading_pin_protects_the_folder_from_retention(
    s3: S3Server, bucket: S3Location, tmp_path: Path
) -> None:
    first = make_checkpoint(tmp_path, 1, {"big.bin": 6 * MIB})
    checks: dict[str, Any] = {}

    def hook(phase: str, detail: Any) -> None:
        if phase == "progress" and "pinned" not in checks:
            checks["pinned"] = (first.path / MARKER_NAME).exists()
            # The trainer saves twice more with keep_last=1 while step 1 is uploading.
            make_checkpoint(tmp_path, 2, {"w.bin": 10}, keep_last=1)
            make_checkpoint(tmp_path, 3, {"w.bin": 10}, keep_last=1)
            checks["kept"] = first.path.exists()
            checks["step 2 pruned"] = not (tmp_path / "step_00000002").exists()

    transfer._phase_hook = hook
    uploader = start_uploader(s3, tmp_path, bucket, storage={"concurrency": 1})
    try:
        wait_for(lambda: state(uploader, "step_00000001") == "done", timeout=20)
        wait_for(lambda: state(uploader, "step_00000003") == "done", timeout=20)
    finally:
        uploader.stop()
    assert checks == {"pinned": True, "kept": True, "step 2 pruned": True}
    assert not (first.path / MARKER_NAME).exists()  # unpinned after the upload
    assert uploader.tracker.get("step_00000002") is None or (
        state(uploader, "step_00000002") == "skipped")


def test_storage_down_keeps_local_checkpoints_reports_degraded_and_catches_up(
    tmp_path: Path
) -> None:
    with running_s3() as server:
        location = server.bucket("down-and-back")
        make_checkpoint(tmp_path, 4, {"w.bin": 10})
        uploader = start_uploader(server, tmp_path, location)
        try:
            wait_for(lambda: state(uploader, "step_00000004") == "done", timeout=20)
            server.stop()  # storage goes down; the trainer saves again
            info = make_checkpoint(tmp_path, 5, {"w.bin": 6 * MIB})
            wait_for(lambda: uploader.tracker.summary()["consecutive_failures"] >= 2, timeout=20)
            summary = uploader.tracker.summary()
            assert summary["status"] == "degraded" and summary["degraded"] is True
            assert "cannot reach the storage endpoint" in summary["error"]
            assert summary["last_durable_step"] == 4
            assert info.path.is_dir()  # kept (pinned only while an attempt runs)
            record = uploader.tracker.get(info.name)
            assert record is not None and record.attempts >= 1
            assert "cannot reach the storage endpoint" in (record.error or "")
            server.start()  # the same port: storage is back
            wait_for(lambda: state(uploader, info.name) == "done", timeout=20)
        finally:
            uploader.stop()
        assert not (info.path / MARKER_NAME).exists()
        summary = uploader.tracker.summary()
        assert summary["status"] == "ok" and summary["error"] is None
        assert summary["last_durable_step"] == 5
        assert location.manifest_key(info.name) in server.keys(location)
        assert [listing.step for listing in list_checkpoints(tmp_path)] == [5, 4]
        metrics = {m.name: m for m in uploader.tracker.collect()}
        assert metrics["esi_sidecar_upload_failures"].samples[0].value >= 2
        assert metrics["esi_sidecar_upload_last_durable_step"].samples[0].value == 5


def test_storage_down_from_the_start_is_reported_before_any_checkpoint(
    tmp_path: Path
) -> None:
    with running_s3() as server:
        location = server.bucket("down-from-start")
        server.stop()
        make_checkpoint(tmp_path, 1, {"w.bin": 10})
        uploader = start_uploader(server, tmp_path, location)
        try:
            wait_for(lambda: uploader.tracker.summary()["degraded"], timeout=20)
            assert state(uploader, "step_00000001") == "pending"
            server.start()
            wait_for(lambda: state(uploader, "step_00000001") == "done", timeout=20)
        finally:
            uploader.stop()
        assert uploader.tracker.summary()["degraded"] is False


def test_a_restarted_uploader_does_not_upload_a_durable_checkpoint_again(
    s3: S3Server, bucket: S3Location, tmp_path: Path
) -> None:
    info = make_checkpoint(tmp_path, 9, {"w.bin": 2 * MIB})
    first = start_uploader(s3, tmp_path, bucket)
    try:
        wait_for(lambda: state(first, info.name) == "done", timeout=20)
    finally:
        first.stop()
    phases: list[str] = []
    transfer._phase_hook = lambda phase, detail: phases.append(phase)
    second = start_uploader(s3, tmp_path, bucket)
    try:
        wait_for(lambda: state(second, info.name) == "done", timeout=20)
    finally:
        second.stop()
    assert phases == []  # no byte sent
    assert second.tracker.get(info.name).note == "already complete in storage"  # type: ignore[union-attr]
    assert second.tracker.summary()["last_durable_step"] == 9


def test_a_resave_under_the_same_name_is_uploaded_again(
    s3: S3Server, bucket: S3Location, tmp_path: Path
) -> None:
    make_checkpoint(tmp_path, 3, {"w.bin": 100})
    uploader = start_uploader(s3, tmp_path, bucket)
    try:
        wait_for(lambda: state(uploader, "step_00000003") == "done", timeout=20)
        again = make_checkpoint(tmp_path, 3, {"w.bin": 200})
        expected = (again.path / "MANIFEST.json").read_bytes()

        def remote_manifest_is_the_new_one() -> bool:
            try:  # absent for a moment: the stale one is deleted first
                return s3.get(bucket, bucket.manifest_key(again.name)) == expected
            except ClientError:
                return False

        wait_for(remote_manifest_is_the_new_one, timeout=20)
    finally:
        uploader.stop()
    assert s3.get(bucket, bucket.key(again.name, "w.bin")) == (again.path / "w.bin").read_bytes()


def test_keep_local_prunes_only_what_is_durable(
    s3: S3Server, bucket: S3Location, tmp_path: Path
) -> None:
    for step in (1, 2):
        make_checkpoint(tmp_path, step, {"w.bin": 10})
    uploader = start_uploader(s3, tmp_path, bucket, keep_local=1)
    try:
        wait_for(lambda: state(uploader, "step_00000002") == "done", timeout=20)
        wait_for(lambda: not (tmp_path / "step_00000001").exists())
    finally:
        uploader.stop()
    assert [listing.step for listing in list_checkpoints(tmp_path)] == [2]


def test_a_drills_checkpoint_not_yet_durable_never_costs_the_newest_durable_one(
    tmp_path: Path,
) -> None:
    """The uploader's pruning (keep_local, protect: not yet settled) while a fire drill's
    checkpoint uploads: the newest durable one stays, here and in storage (nothing there
    is ever deleted), whatever keep_local says."""
    for step in (1, 2, 3):
        make_checkpoint(tmp_path, step, {"w.bin": 10})
    settled = {"step_00000001", "step_00000002"}  # step 3: the drill's, uploading
    removed = prune(tmp_path, 1, protect=lambda info: info.name not in settled)
    assert [path.name for path in removed] == ["step_00000001"]
    assert [listing.step for listing in list_checkpoints(tmp_path)] == [3, 2]


def test_a_new_checkpoint_is_noticed_through_inotify_without_waiting_for_the_rescan(
    s3: S3Server, bucket: S3Location, tmp_path: Path
) -> None:
    uploader = start_uploader(s3, tmp_path, bucket, scan_interval_seconds=3600.0)
    try:
        wait_for(lambda: uploader._watch.active or not tmp_path.is_dir(), timeout=10)
        make_checkpoint(tmp_path, 11, {"w.bin": 10})
        wait_for(lambda: state(uploader, "step_00000011") == "done", timeout=10)
    finally:
        uploader.stop()
