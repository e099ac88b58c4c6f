"""The volume's committed files and its identity (issue 35, items 2, 3 and 8; issue 41).

A file committed on the volume is never written again: files shared between durable
checkpoints are hard links, so one write in place would change every checkpoint that
holds it. And the volume proves it is the volume it was, across restarts too: its
identity (the marker's id, the mount it is on) is kept in the daemon's state file.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import time
from pathlib import Path
from typing import Any, Optional

import pytest
from daemon_harness import get_json, serve_daemon, wait_for

from sidecar.checkpoint.folders import atomic_checkpoint, latest_valid
from sidecar.checkpoint.manifest import MANIFEST_NAME, CheckpointInfo
from sidecar.host.upload.commit_check import DurableFile
from sidecar.host.upload.identity import VOLUME_MARKER
from sidecar.host.upload.volume import Cancelled, VolumeDestination
from sidecar.train.client import SidecarClient

REPO = Path(__file__).resolve().parents[3]
KIB = 1 << 10


def save(root: Path, step: int, files: dict[str, bytes]) -> CheckpointInfo:
    checkpoint = atomic_checkpoint(root, step, checksum=True)
    with checkpoint as folder:
        for relative, data in files.items():
            (folder / relative).write_bytes(data)
    assert checkpoint.info is not None
    return checkpoint.info


def commit(destination: VolumeDestination, info: CheckpointInfo,
           durable: Optional[dict[str, DurableFile]] = None) -> None:
    destination.upload(info, (info.path / MANIFEST_NAME).read_bytes(),
                       on_progress=lambda count: None, should_stop=lambda: None,
                       before_manifest=lambda: None, durable=durable or {})


def fingerprint(path: Path) -> tuple[int, int, str]:
    """The inode, its size and the sha256 of its bytes."""
    found = os.lstat(path)
    return found.st_ino, found.st_size, hashlib.sha256(path.read_bytes()).hexdigest()


def never_stop() -> Optional[str]:
    return None


# ---------------------------------------------------------------- committed files


def test_a_committed_file_shared_by_two_checkpoints_is_never_written_again(
    tmp_path: Path,
) -> None:
    """Two durable checkpoints share ``frozen.bin`` (one inode, two links). Staging it for
    a third checkpoint, sending it again after it changed, copying it twice, a send cut
    short and a re-upload of the second checkpoint leave that inode's bytes as they were."""
    local, volume = tmp_path / "local", tmp_path / "volume"
    local.mkdir()
    volume.mkdir()
    frozen = os.urandom(64 * KIB)
    destination = VolumeDestination(volume)
    destination.prepare(time.time())
    commit(destination, save(local, 1, {"frozen.bin": frozen, "w.bin": os.urandom(KIB)}))
    second = save(local, 2, {"frozen.bin": frozen, "w.bin": os.urandom(KIB)})
    commit(destination, second, destination.durable_files("step_00000001"))
    shared = volume / "step_00000001" / "frozen.bin"
    before = fingerprint(shared)
    assert os.lstat(shared).st_nlink == 2  # one file, two durable checkpoints
    assert fingerprint(volume / "step_00000002" / "frozen.bin") == before
    for committed in (volume / "step_00000001").iterdir():
        assert stat.S_IMODE(os.lstat(committed).st_mode) == 0o444, committed

    durable = destination.durable_files("step_00000002")
    third = save(local, 3, {"frozen.bin": frozen, "w.bin": os.urandom(KIB)})
    staging = destination.open_staging("step_00000003")
    key = (0, len(frozen), 0, 0)
    assert staging.copy("frozen.bin", durable["frozen.bin"], key) is not None  # a link
    assert staging.copy("frozen.bin", durable["frozen.bin"], key) is not None  # again
    (third.path / "frozen.bin").write_bytes(b"the job wrote this later")
    staging.send(third.path, "frozen.bin", on_progress=lambda count: None,
                 should_stop=never_stop)  # the changed file is sent again
    assert fingerprint(shared) == before
    assert staging.copy("frozen.bin", durable["frozen.bin"], key) is not None

    def stop_at_once() -> Optional[str]:
        return "stopped for the test"

    with pytest.raises(Cancelled):  # an attempt that fails half-way
        staging.send(third.path, "frozen.bin", on_progress=lambda count: None,
                     should_stop=stop_at_once)
    assert fingerprint(shared) == before
    staging.discard()

    commit(destination, second, durable)  # the same checkpoint uploaded again
    assert fingerprint(shared) == before
    assert (volume / "step_00000002" / "frozen.bin").read_bytes() == frozen
    assert latest_valid(volume, verify_checksums=True).step == 2  # type: ignore[union-attr]


def test_a_marker_overwritten_in_place_is_written_back_and_uploads_go_on(
    tmp_path: Path,
) -> None:
    """Item 3: one write over ``.esi-sidecar-volume`` (what the uploader's pin once wrote
    there) does not stop uploads for good: on the very mount the daemon confirmed, the
    marker is written back from memory, read-only."""
    local, volume = tmp_path / "local", tmp_path / "volume"
    local.mkdir()
    volume.mkdir()
    destination = VolumeDestination(volume)
    destination.prepare(time.time())
    commit(destination, save(local, 1, {"w.bin": os.urandom(KIB)}))
    marker = volume / VOLUME_MARKER
    known = marker.read_bytes()
    marker.write_text(f"esi-sidecar uploader pid={os.getpid()}\n")  # root ignores modes
    commit(destination, save(local, 2, {"w.bin": os.urandom(KIB)}))
    assert marker.read_bytes() == known
    assert stat.S_IMODE(os.lstat(marker).st_mode) == 0o444
    assert latest_valid(volume).step == 2  # type: ignore[union-attr]


def test_a_folder_swapped_for_another_volumes_is_not_durable(tmp_path: Path) -> None:
    """Issue 41: the marker check itself, not the missing marker, refuses a folder that
    another volume (with its own marker) took the place of, on the same file system."""
    local, volume, other = tmp_path / "local", tmp_path / "volume", tmp_path / "other"
    for folder in (local, volume, other):
        folder.mkdir()
    destination = VolumeDestination(volume)
    destination.prepare(time.time())
    commit(destination, save(local, 1, {"w.bin": os.urandom(KIB)}))
    elsewhere = VolumeDestination(other)
    elsewhere.prepare(time.time())
    commit(elsewhere, save(local, 2, {"w.bin": os.urandom(KIB)}))  # other's own marker
    volume.rename(tmp_path / "volume-away")
    other.rename(volume)
    with pytest.raises(Exception, match=f"its {VOLUME_MARKER} names another volume"):
        commit(destination, save(local, 3, {"w.bin": os.urandom(KIB)}))
    assert sorted(p.name for p in volume.iterdir()) == [VOLUME_MARKER, "step_00000002"]


# ---------------------------------------------------------------- across a restart


def daemon_settings(local: Path, volume: Path, state: Path) -> dict[str, Any]:
    return {"sources": ("static",), "expires_at": str(time.time() + 3600),
            "upload_from": local, "upload_to": volume.as_uri(), "upload_scan_interval": 0.1,
            "state_file": state}


def uploads(url: str) -> dict[str, Any]:
    status, body = get_json(url + "/v1/uploads")
    assert status == 200
    return body


def test_a_daemon_restarted_while_its_volume_is_missing_refuses_the_empty_place(
    tmp_path: Path,
) -> None:
    """Item 8: the volume is gone (its mount point an empty folder, no marker) when the
    daemon starts again. It remembers the volume, so it refuses, says why in
    ``/v1/uploads`` and ``/healthz``, writes nothing there, and goes on once it is back."""
    local, volume, state = tmp_path / "local", tmp_path / "mnt", tmp_path / "state.json"
    local.mkdir()
    volume.mkdir()
    save(local, 1, {"w.bin": os.urandom(KIB)})
    with serve_daemon(**daemon_settings(local, volume, state)) as daemon:
        client = SidecarClient(daemon.url, timeout=5)
        wait_for(lambda: client.last_durable_step() == 1, timeout=30)
    marker_id = (volume / VOLUME_MARKER).read_text().split()[-1]
    kept = json.loads(state.read_text())["volume"][str(volume)]
    assert kept["volume_id"] == marker_id and kept["device"] == os.stat(volume).st_dev

    volume.rename(tmp_path / "mnt-unmounted")
    volume.mkdir()  # what an unmount leaves: the empty mount-point folder
    save(local, 2, {"w.bin": os.urandom(KIB)})
    with serve_daemon(**daemon_settings(local, volume, state)) as daemon:
        wait_for(lambda: uploads(daemon.url)["degraded"], timeout=30)
        error = uploads(daemon.url)["error"]
        assert error.endswith(f"destination {volume} is not the volume it was: not mounted? "
                              f"(its {VOLUME_MARKER} is missing; the daemon's volume has id "
                              f"{marker_id[:8]}..., kept in its state file)"), error
        health = get_json(daemon.url + "/healthz")[1]
        assert health["uploads"]["error"] == error
        assert uploads(daemon.url)["last_durable_step"] is None  # nothing called durable
    assert list(volume.iterdir()) == []  # not a byte on the host's own disk
    assert json.loads(state.read_text())["volume"][str(volume)]["volume_id"] == marker_id

    volume.rmdir()
    (tmp_path / "mnt-unmounted").rename(volume)  # mounted again
    with serve_daemon(**daemon_settings(local, volume, state)) as daemon:
        client = SidecarClient(daemon.url, timeout=5)
        wait_for(lambda: client.last_durable_step() == 2, timeout=30)


def test_a_daemon_restarted_on_another_volume_refuses_it(tmp_path: Path) -> None:
    """Issue 41: after a restart, another volume with its own marker in the volume's
    place is refused by the marker check (the restarted daemon remembers the id)."""
    local, volume, state = tmp_path / "local", tmp_path / "mnt", tmp_path / "state.json"
    other = tmp_path / "other"
    for folder in (local, volume, other):
        folder.mkdir()
    save(local, 1, {"w.bin": os.urandom(KIB)})
    with serve_daemon(**daemon_settings(local, volume, state)) as daemon:
        client = SidecarClient(daemon.url, timeout=5)
        wait_for(lambda: client.last_durable_step() == 1, timeout=30)
    elsewhere = VolumeDestination(other)
    elsewhere.prepare(time.time())
    elsewhere.identity.confirm()  # another volume: a marker of its own
    volume.rename(tmp_path / "mnt-away")
    other.rename(volume)
    with serve_daemon(**daemon_settings(local, volume, state)) as daemon:
        wait_for(lambda: uploads(daemon.url)["degraded"], timeout=30)
        assert f"its {VOLUME_MARKER} names another volume" in uploads(daemon.url)["error"]
    assert [p.name for p in volume.iterdir()] == [VOLUME_MARKER]
