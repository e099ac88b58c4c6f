"""The uploader's and restore's safety (issue 22, items 1, 3, 4 and the backoff): a volume
proves it is the volume it was before a copy counts as durable; no link ever leads a byte
from outside a checkpoint to a destination or back; every copy is checked against the
manifest while it is read, and restore takes the newest checkpoint that is valid.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import wait_for
from upload_support import record, state, uploading

from sidecar.checkpoint.folders import atomic_checkpoint, latest_valid
from sidecar.checkpoint.manifest import MANIFEST_NAME, CheckpointInfo, Invalid
from sidecar.host.upload.identity import VOLUME_MARKER
from sidecar.host.upload.status import UploadRecord
from sidecar.host.upload.volume import (
    COPY_ATTEMPTS,
    RestoreError,
    VolumeDestination,
    copy_checkpoint,
    restore_from_volume,
)

REPO = Path(__file__).resolve().parents[3]
SECRET = b"root-only secret: the daemon's token\n"


def save(root: Path, step: int, files: dict[str, bytes]) -> CheckpointInfo:
    checkpoint = atomic_checkpoint(root, step, checksum=True)
    with checkpoint as folder:
        for relative, data in files.items():
            (folder / relative).parent.mkdir(parents=True, exist_ok=True)
            (folder / relative).write_bytes(data)
    assert checkpoint.info is not None
    return checkpoint.info


def manifest_of(info: CheckpointInfo) -> bytes:
    return (info.path / MANIFEST_NAME).read_bytes()



def every_byte(folder: Path) -> bytes:
    return b"".join(p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file())


# ---------------------------------------------------------------- item 1: the volume


def test_a_volume_folder_swapped_for_an_empty_one_is_not_durable(tmp_path: Path) -> None:
    """The volume goes (its mount point is an empty folder again): nothing counts as
    durable there, nothing is written there, and uploads resume once it is back."""
    local, volume = tmp_path / "local", tmp_path / "mnt"
    local.mkdir()
    volume.mkdir()
    save(local, 1, {"model.pt": os.urandom(1000)})
    with uploading(local, VolumeDestination(volume)) as uploader:
        wait_for(lambda: state(uploader, "step_00000001") == "done", timeout=20)
        gone = tmp_path / "mnt-unmounted"
        volume.rename(gone)
        volume.mkdir()  # what an unmount leaves: the empty mount-point folder
        save(local, 2, {"model.pt": os.urandom(1000)})
        wait_for(lambda: state(uploader, "step_00000002") == "failed", timeout=20)
        failed = record(uploader, "step_00000002")
        assert failed is not None and failed.error is not None
        assert f"destination {volume} is not the volume it was: not mounted?" in failed.error
        assert uploader.tracker.last_durable().step == 1  # type: ignore[union-attr]
        assert list(volume.iterdir()) == []  # not a byte on the host's own disk
        volume.rmdir()
        gone.rename(volume)  # mounted again
        wait_for(lambda: state(uploader, "step_00000002") == "done", timeout=20)
    assert latest_valid(volume, verify_checksums=True).step == 2  # type: ignore[union-attr]
    assert (volume / VOLUME_MARKER).is_file()


def test_a_restarted_uploader_refuses_the_empty_place_of_a_volume_fstab_mounts(
    tmp_path: Path,
) -> None:
    local, volume = tmp_path / "local", tmp_path / "mnt" / "vepfs"
    local.mkdir()
    volume.mkdir(parents=True)
    fstab = tmp_path / "fstab"
    fstab.write_text(f"# a comment\nnas:/export {volume} nfs defaults 0 0\n"
                     "/dev/sdb none swap sw 0 0\n")
    save(local, 1, {"model.pt": os.urandom(100)})
    with uploading(local, VolumeDestination(volume, fstab=fstab)) as uploader:
        wait_for(lambda: uploader.tracker.summary()["degraded"], timeout=20)
        error = uploader.tracker.summary()["error"]
        assert f"destination {volume} is not the volume it was: not mounted?" in error
        assert f"{fstab} mounts {volume}, which is not mounted now" in error
        assert state(uploader, "step_00000001") == "pending"
    assert list(volume.iterdir()) == []


_NAMESPACE_SCRIPT = textwrap.dedent("""
    import json, os, subprocess, sys, time
    from pathlib import Path
    from sidecar.checkpoint.folders import atomic_checkpoint
    from sidecar.host.upload.uploader import Uploader, UploaderConfig
    from sidecar.host.upload.volume import VolumeDestination

    base = Path(sys.argv[1])
    local, mnt = base / "local", base / "mnt"
    subprocess.run(["mount", "-t", "tmpfs", "esi-test", str(mnt)], check=True)

    def save(step):
        with atomic_checkpoint(local, step) as folder:
            (folder / "model.pt").write_bytes(os.urandom(1000))

    def until(check):
        deadline = time.monotonic() + 20
        while not check():
            if time.monotonic() > deadline:
                raise SystemExit("timed out")
            time.sleep(0.02)

    def state(uploader, name):
        record = uploader.tracker.get(name)
        return record and record.state

    config = UploaderConfig(root=local, location=None, scan_interval_seconds=0.1,
                            backoff_base_seconds=0.05, backoff_cap_seconds=0.4)
    uploader = Uploader(config, destination=VolumeDestination(mnt))
    save(1)
    uploader.start()
    until(lambda: state(uploader, "step_00000001") == "done")
    subprocess.run(["umount", str(mnt)], check=True)
    save(2)
    until(lambda: state(uploader, "step_00000002") == "failed")
    out = {"error": uploader.tracker.get("step_00000002").error,
           "durable": uploader.tracker.last_durable().step,
           "left_on_disk": sorted(p.name for p in mnt.iterdir())}
    # Another (empty) file system mounted in its place is not the volume either.
    subprocess.run(["mount", "-t", "tmpfs", "esi-other", str(mnt)], check=True)
    save(3)
    until(lambda: state(uploader, "step_00000003") == "failed")
    out["other_error"] = uploader.tracker.get("step_00000003").error
    out["durable_after"] = uploader.tracker.last_durable().step
    uploader.stop(timeout=5)
    print(json.dumps(out))
""")


def test_a_volume_unmounted_under_the_uploader_is_not_durable(tmp_path: Path) -> None:
    """A real mount (tmpfs, in a private mount namespace) unmounted under the uploader."""
    unshare = shutil.which("unshare")
    if os.geteuid() != 0 or unshare is None:
        pytest.skip("needs root and unshare(1) for a private mount namespace")
    probe = subprocess.run([unshare, "--mount", "--propagation", "private", "true"],
                           capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"no private mount namespace here: {probe.stderr.decode()[:100]}")
    (tmp_path / "local").mkdir()
    (tmp_path / "mnt").mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    result = subprocess.run(
        [unshare, "--mount", "--propagation", "private", sys.executable, "-c",
         _NAMESPACE_SCRIPT, str(tmp_path)], capture_output=True, text=True, env=env,
        timeout=120, cwd=REPO)
    assert result.returncode == 0, result.stderr[-2000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    mnt = tmp_path / "mnt"
    assert f"destination {mnt} is not the volume it was: not mounted?" in out["error"]
    assert out["durable"] == 1 and out["left_on_disk"] == []
    assert "is not the volume it was" in out["other_error"]
    assert out["durable_after"] == 1


# ---------------------------------------------------------------- item 3: links


def secret_file(tmp_path: Path, size: int) -> Path:
    secret = tmp_path / "root-only"
    secret.write_bytes(SECRET.ljust(size, b"#"))
    secret.chmod(0o600)
    return secret


def test_a_file_swapped_for_a_link_is_never_copied_to_a_volume(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    local, volume = tmp_path / "local", tmp_path / "volume"
    local.mkdir()
    volume.mkdir()
    info = save(local, 1, {"model.pt": os.urandom(200), "sub/rng.json": b"{}" * 50})
    secret = secret_file(tmp_path, 200)
    (info.path / "model.pt").unlink()
    (info.path / "model.pt").symlink_to(secret)  # the same size as the file it replaces
    # The copy refuses it, whenever the swap came (here: after the listing).
    with pytest.raises(Invalid, match=r"model\.pt is a symbolic link"):
        copy_checkpoint(info, manifest_of(info), volume)
    # The uploader never takes it for a complete checkpoint, and says why, once.
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "rng.json").write_bytes(SECRET.ljust(100, b"#"))
    linked = save(local, 2, {"model.pt": os.urandom(200), "sub/rng.json": b"{}" * 50})
    shutil.rmtree(linked.path / "sub")
    (linked.path / "sub").symlink_to(outside, target_is_directory=True)  # a linked folder
    caplog.set_level(logging.INFO, logger="sidecar.host.upload")

    def refusals() -> list[str]:
        return [r.getMessage() for r in caplog.records if "not uploading" in r.getMessage()]

    with uploading(local, VolumeDestination(volume)) as uploader:
        wait_for(lambda: len(refusals()) >= 2, timeout=20)
        scans = len(caplog.records)
        save(local, 3, {"model.pt": os.urandom(10)})  # later scans: no repeats
        wait_for(lambda: state(uploader, "step_00000003") == "done", timeout=20)
    assert len(caplog.records) > scans
    lines = refusals()
    assert len(lines) == 2, lines
    assert any(line.startswith("not uploading step_00000001: model.pt is a symbolic link")
               for line in lines)
    assert any(line.startswith("not uploading step_00000002: sub is a symbolic link")
               for line in lines)
    assert SECRET not in every_byte(volume)
    assert latest_valid(local).step == 3  # type: ignore[union-attr]


def test_restore_refuses_links_on_the_volume_and_takes_the_newest_valid_one(
    tmp_path: Path,
) -> None:
    volume, fresh = tmp_path / "volume", tmp_path / "fresh"
    good = save(tmp_path / "local", 1, {"model.pt": os.urandom(100)})
    volume.mkdir()
    copy_checkpoint(good, manifest_of(good), volume)
    linked = save(tmp_path / "local", 2, {"sub/model.pt": os.urandom(len(SECRET))})
    copied = copy_checkpoint(linked, manifest_of(linked), volume)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "model.pt").write_bytes(SECRET)
    shutil.rmtree(copied / "sub")
    (copied / "sub").symlink_to(outside, target_is_directory=True)
    result = subprocess.run(
        [sys.executable, "-m", "sidecar.cli", "restore", "--from", volume.as_uri(),
         "--to", str(fresh)], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "restored step_00000001 (step 1" in result.stdout
    assert f"skipping {copied}" in result.stderr and "sub is a symbolic link" in result.stderr
    assert SECRET not in every_byte(fresh)


def test_a_file_swapped_for_a_link_is_never_uploaded_to_s3(tmp_path: Path) -> None:
    support = pytest.importorskip("upload_support")
    from sidecar.host.upload.location import S3Location

    monkeypatch = pytest.MonkeyPatch()
    try:
        support.isolate_aws_env(monkeypatch)
        with support.running_s3() as s3:
            location: S3Location = s3.bucket("links")
            info = save(tmp_path / "local", 1, {"model.pt": os.urandom(64 * 1024)})
            secret = secret_file(tmp_path, 64 * 1024)
            (info.path / "model.pt").unlink()
            (info.path / "model.pt").symlink_to(secret)
            with pytest.raises(Invalid, match=r"model\.pt is a symbolic link"):
                support.commit_to_s3(s3, location, info)
            assert s3.keys(location) == []
            # An honest checkpoint still goes, through the opened file.
            honest = save(tmp_path / "local", 2, {"model.pt": os.urandom(11 << 20)})
            support.commit_to_s3(s3, location, honest)
            key = location.key(honest.name, "model.pt")
            assert s3.get(location, key) == (honest.path / "model.pt").read_bytes()
    finally:
        monkeypatch.undo()


# ---------------------------------------------------------------- item 4: copies checked


def test_a_file_that_grows_while_it_is_copied_is_never_committed(tmp_path: Path) -> None:
    local, volume = tmp_path / "local", tmp_path / "volume"
    volume.mkdir()
    info = save(local, 1, {"model.pt": os.urandom(4096)})
    appended = []

    def append(count: int) -> None:  # the trainer writes on into a committed checkpoint
        if count > 0:
            with open(info.path / "model.pt", "ab") as handle:
                handle.write(b"more")
            appended.append(count)

    with pytest.raises(Invalid, match=f"model.pt does not match its manifest in "
                                      f"{COPY_ATTEMPTS} copies \\(more than the 4096 bytes"):
        copy_checkpoint(info, manifest_of(info), volume, on_progress=append)
    assert len(appended) >= COPY_ATTEMPTS  # copied again each time
    assert [p.name for p in volume.iterdir()] == []  # nothing under the name, no leftover


def test_a_file_rewritten_during_one_copy_is_copied_again(tmp_path: Path) -> None:
    volume = tmp_path / "volume"
    volume.mkdir()
    original = os.urandom(4096)
    info = save(tmp_path / "local", 1, {"model.pt": original})
    rewrites = []

    def rewrite_once(count: int) -> None:  # same size, other bytes, then put back
        path = info.path / "model.pt"
        if count > 0 and not rewrites:
            path.write_bytes(os.urandom(4096))
            rewrites.append(1)
        elif count > 0 and len(rewrites) == 1:
            path.write_bytes(original)
            rewrites.append(2)

    final = copy_checkpoint(info, manifest_of(info), volume, on_progress=rewrite_once)
    assert (final / "model.pt").read_bytes() == original
    assert latest_valid(volume, verify_checksums=True).step == 1  # type: ignore[union-attr]


def test_the_uploader_never_reports_a_copy_that_does_not_match_as_durable(
    tmp_path: Path,
) -> None:
    local, volume = tmp_path / "local", tmp_path / "volume"
    local.mkdir()
    volume.mkdir()
    original = os.urandom(4096)
    info = save(local, 1, {"model.pt": original})
    changed = os.urandom(4096)
    (info.path / "model.pt").write_bytes(changed)  # rewritten in place after the commit
    with uploading(local, VolumeDestination(volume)) as uploader:
        wait_for(lambda: state(uploader, "step_00000001") == "failed", timeout=20)
        failed = record(uploader, "step_00000001")
        assert failed is not None and "sha256 differs" in (failed.error or "")
        assert uploader.tracker.last_durable() is None
    assert not (volume / "step_00000001").exists()


def test_restore_skips_a_volume_copy_that_does_not_match_and_takes_the_previous(
    tmp_path: Path,
) -> None:
    volume, fresh = tmp_path / "volume", tmp_path / "fresh"
    volume.mkdir()
    older = save(tmp_path / "local", 1, {"model.pt": os.urandom(300)})
    copy_checkpoint(older, manifest_of(older), volume)
    newer = save(tmp_path / "local", 2, {"model.pt": os.urandom(300)})
    damaged = copy_checkpoint(newer, manifest_of(newer), volume)
    (damaged / "model.pt").write_bytes(os.urandom(300))  # same size, other bytes
    result = subprocess.run(
        [sys.executable, "-m", "sidecar.cli", "restore", "--from", volume.as_uri(),
         "--to", str(fresh)], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "restored step_00000001 (step 1" in result.stdout
    assert f"skipping {damaged}" in result.stderr and "sha256" in result.stderr
    assert latest_valid(fresh, verify_checksums=True).step == 1  # type: ignore[union-attr]
    # Nothing valid at all: a failure (exit 1), not a fresh start (exit 3).
    shutil.rmtree(volume / older.name)
    with pytest.raises(RestoreError, match=r"no valid checkpoint in .*1 skipped") as caught:
        restore_from_volume(volume, tmp_path / "other")
    assert caught.value.exit_code == 1


# ---------------------------------------------------------------- backoff


class FullVolume(VolumeDestination):
    """A volume that answers reads but has no space left (the storage's own edge)."""

    def upload(self, info: CheckpointInfo, manifest: bytes, **kwargs: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_volume_backs_off_counts_and_warns_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    local, volume = tmp_path / "local", tmp_path / "volume"
    local.mkdir()
    volume.mkdir()
    save(local, 1, {"model.pt": os.urandom(100)})
    caplog.set_level(logging.DEBUG, logger="sidecar.host.upload")
    with uploading(local, FullVolume(volume)) as uploader:
        wait_for(lambda: (record(uploader, "step_00000001") or UploadRecord(
            "x", 0, 0.0, "", 0, 0)).attempts >= 4, timeout=20)
    lines = [r for r in caplog.records if "the volume is full" in r.getMessage()]
    assert "failure 3 in a row" in " ".join(r.getMessage() for r in lines)
    assert [r.levelno for r in lines].count(logging.WARNING) == 1
