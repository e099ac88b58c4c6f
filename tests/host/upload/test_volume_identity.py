"""The volume's committed files and its identity (issue 35, items 2, 3 and 8; issue 41).

A file committed on the volume is never written again: files shared between durable
checkpoints are hard links, so one write in place would change every checkpoint that
holds it. And the volume proves it is the volume it was, across restarts too: its
identity (the marker's id, the mount it is on) is kept in the daemon's state file.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any, Optional

import pytest
from daemon_harness import get_json, serve_daemon, wait_for

from sidecar.checkpoint.folders import atomic_checkpoint, latest_valid
from sidecar.checkpoint.manifest import MANIFEST_NAME, CheckpointInfo
from sidecar.host.statefile import StateFile
from sidecar.host.upload.commit_check import DurableFile
from sidecar.host.upload.identity import VOLUME_MARKER, NotTheVolume, VolumeIdentity
from sidecar.host.upload.volume import Cancelled, VolumeDestination
from sidecar.host.upload.volume_section import MAX_FOLDERS, VolumeSection
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


def restarted(path: Path, volume: Path) -> VolumeIdentity:
    identity = VolumeIdentity(volume)
    state = StateFile(path)
    state.add(VolumeSection(identity, on_change=state.write))
    state.load()
    return identity


def test_the_volume_section_keeps_the_identity_and_a_bad_one_is_ignored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    volume, path = tmp_path / "volume", tmp_path / "state.json"
    volume.mkdir()
    identity = VolumeIdentity(volume)
    state = StateFile(path)
    state.add(VolumeSection(identity, on_change=state.write))
    state.load()
    identity.confirm()  # the first use: the marker written, the state written at once
    remembered = identity.remembered
    assert remembered is not None
    kept = json.loads(path.read_text())["volume"]
    assert kept == {str(volume): {
        "volume_id": identity.volume_id, "mount_point": str(remembered.mount.point),
        "mount_id": remembered.mount.mount_id, "device": os.stat(volume).st_dev}}
    assert restarted(path, volume).remembered == identity.remembered

    others = {f"/mnt/other-{n}": {**kept[str(volume)], "mount_id": n} for n in range(20)}
    path.write_text(json.dumps({"version": 1, "volume": {**others, **kept}}))
    again = restarted(path, volume)
    assert again.remembered == identity.remembered
    again.on_change(remembered)  # written back: the newest others, bounded
    written = json.loads(path.read_text())["volume"]
    assert len(written) == MAX_FOLDERS + 1 and "/mnt/other-19" in written

    for bad in ({"volume_id": "not an id"}, {"mount_id": True}, {"mount_point": "run"},
                {"extra": 1}):
        path.write_text(json.dumps({"version": 1, "volume": {
            str(volume): {**kept[str(volume)], **bad}}}))
        with caplog.at_level("WARNING", logger="sidecar.host.statefile"):
            assert restarted(path, volume).remembered is None
        assert "ignoring the volume's identity in state file" in caplog.text
        caplog.clear()


# ---------------------------------------------------------------- real mounts (issue 41)

# Runs in a private mount namespace: the volume is a folder ("store") bind-mounted at
# "mnt", the destination is mnt/run. Step 1 is committed, then the scenario changes the
# mounts and tries step 2 with the same destination ("within") and with a restarted one
# that knows only what the state file's section kept ("restart"); "back" puts the volume
# back and commits step 2.
_MOUNTS = textwrap.dedent("""
    import json, os, subprocess, sys, time
    from pathlib import Path
    from sidecar.checkpoint.folders import atomic_checkpoint
    from sidecar.host.upload.identity import VOLUME_MARKER, mount_now
    from sidecar.host.upload.volume import VolumeDestination
    from sidecar.host.upload.volume_section import VolumeSection

    base, scenario = Path(sys.argv[1]), sys.argv[2]
    local, store, mnt = base / "local", base / "store", base / "mnt"
    root = mnt / "run"

    def run(*command):
        subprocess.run(command, check=True)

    def commit(destination, step):
        with atomic_checkpoint(local, step, checksum=True) as folder:
            (folder / "w.bin").write_bytes(os.urandom(1000))
        info = [p for p in local.iterdir() if p.name == f"step_{step:08d}"][0]
        raw = (info / "MANIFEST.json").read_bytes()
        from sidecar.checkpoint.folders import validate
        destination.upload(validate(info), raw, on_progress=lambda c: None,
                           should_stop=lambda: None, before_manifest=lambda: None)

    def attempt(action):
        try:
            action()
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        return "accepted"

    def restarted():
        destination = VolumeDestination(root)
        VolumeSection(destination.identity, lambda: None).load(json.loads(kept))
        return destination

    run("mount", "--bind", str(store), str(mnt))
    destination = VolumeDestination(root)
    destination.prepare(time.time())
    commit(destination, 1)
    kept = json.dumps(VolumeSection(destination.identity, lambda: None).dump())
    marker = (root / VOLUME_MARKER).read_bytes()
    out = {"mount": str(mnt), "beneath": str(mount_now(base).point)}
    if scenario == "beneath":  # unmounted, a stale copy of the marker on the disk beneath
        run("umount", str(mnt))
        root.mkdir()
        (root / VOLUME_MARKER).write_bytes(marker)
    elif scenario == "changed":  # another file system mounted nearer, the marker copied in
        run("mount", "-t", "tmpfs", "esi-changed", str(root))
        (root / VOLUME_MARKER).write_bytes(marker)
    elif scenario == "another":  # another volume, with its own marker, in the volume's place
        run("umount", str(mnt))
        run("mount", "-t", "tmpfs", "esi-another", str(mnt))
        root.mkdir()
        VolumeDestination(root).identity.confirm()
    elif scenario == "damaged":  # another file system whose marker does not parse
        run("umount", str(mnt))
        run("mount", "-t", "tmpfs", "esi-damaged", str(mnt))
        root.mkdir()
        (root / VOLUME_MARKER).write_text("esi-sidecar uploader pid=1\\n")
    out["within"] = attempt(lambda: commit(destination, 2))
    out["restart"] = attempt(lambda: restarted().prepare(time.time()))
    out["left"] = sorted(p.name for p in root.iterdir())
    if scenario == "changed":
        run("umount", str(root))
    else:
        if scenario in ("another", "damaged"):
            run("umount", str(mnt))
        run("mount", "--bind", str(store), str(mnt))  # the volume back: another mount id
    again = restarted()
    out["back"] = attempt(lambda: (again.prepare(time.time()), commit(again, 3)))
    out["back_within"] = attempt(lambda: commit(destination, 4))
    out["committed"] = sorted(p.name for p in root.iterdir() if p.name.startswith("step_"))
    print(json.dumps(out))
""")


def in_mount_namespace(tmp_path: Path, scenario: str) -> dict[str, Any]:
    unshare = shutil.which("unshare")
    if os.geteuid() != 0 or unshare is None:
        pytest.skip("needs root and unshare(1) for a private mount namespace")
    for folder in ("local", "store/run", "mnt"):
        (tmp_path / folder).mkdir(parents=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}
    result = subprocess.run(
        [unshare, "--mount", "--propagation", "private", sys.executable, "-c", _MOUNTS,
         str(tmp_path), scenario], capture_output=True, text=True, env=env, timeout=120,
        cwd=REPO)
    assert result.returncode == 0, result.stderr[-2000:]
    found: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    return found


def not_the_volume(root: str, why: str) -> str:
    return f"NotTheVolume: destination {root} is not the volume it was: not mounted? ({why})"


def test_a_stale_marker_beneath_an_unmounted_volume_is_not_the_volume(
    tmp_path: Path,
) -> None:
    """The volume is unmounted and a copy of its marker lies on the disk beneath: the
    mount check refuses it, while running and after a restart; a remount is the volume."""
    out = in_mount_namespace(tmp_path, "beneath")
    root, mnt = f"{out['mount']}/run", out["mount"]
    beneath = out["beneath"]  # the file system the empty mount point is on
    assert out["within"] == not_the_volume(
        root, f"it is no longer on the file system mounted at {mnt}, but on the one at "
        f"{beneath}")
    assert out["restart"] == not_the_volume(
        root, f"it was on the file system mounted at {mnt}, now it is on the one at {beneath}")
    assert out["left"] == [VOLUME_MARKER]  # nothing written beneath
    assert out["back"] == "accepted" and out["back_within"] == "accepted"
    assert out["committed"] == ["step_00000001", "step_00000003", "step_00000004"]


def test_another_file_system_mounted_nearer_the_folder_is_not_the_volume(
    tmp_path: Path,
) -> None:
    """A changed mount: another file system mounted at the folder itself, holding a copy
    of the marker. Refused while running and after a restart."""
    out = in_mount_namespace(tmp_path, "changed")
    root, mnt = f"{out['mount']}/run", out["mount"]
    assert out["within"] == not_the_volume(
        root, f"it is no longer on the file system mounted at {mnt}, but on the one at {root}")
    assert out["restart"] == not_the_volume(
        root, f"it was on the file system mounted at {mnt}, now it is on the one at {root}")
    assert out["left"] == [VOLUME_MARKER]
    assert out["back"] == "accepted" and out["back_within"] == "accepted"
    assert out["committed"] == ["step_00000001", "step_00000003", "step_00000004"]


def test_another_volume_mounted_in_its_place_is_not_the_volume(tmp_path: Path) -> None:
    """Another volume with a marker of its own mounted at the same mount point: the
    marker check refuses it (the mount point is the same), while running and after a
    restart."""
    out = in_mount_namespace(tmp_path, "another")
    root = f"{out['mount']}/run"
    why = f"its {VOLUME_MARKER} names another volume"
    assert out["within"] == not_the_volume(root, why)
    assert out["restart"] == not_the_volume(root, why)
    assert out["left"] == [VOLUME_MARKER]
    assert out["back"] == "accepted" and out["back_within"] == "accepted"
    assert out["committed"] == ["step_00000001", "step_00000003", "step_00000004"]


def test_a_damaged_marker_on_another_mount_is_not_written_back(tmp_path: Path) -> None:
    """A marker that does not parse is written back only on the very mount the daemon
    confirmed: on another file system at the mount point it is refused."""
    out = in_mount_namespace(tmp_path, "damaged")
    root = f"{out['mount']}/run"
    assert out["within"].startswith(not_the_volume(root, f"its {VOLUME_MARKER} is damaged;")[:-1])
    assert out["restart"].startswith(not_the_volume(root, f"its {VOLUME_MARKER} is damaged;")[:-1])
    assert out["left"] == [VOLUME_MARKER]
    assert out["back"] == "accepted" and out["back_within"] == "accepted"
    assert out["committed"] == ["step_00000001", "step_00000003", "step_00000004"]


# ------------------------------------------- the identity's own checks, on a mountinfo
# The mount namespace tests above run the uploader in a child process, which the
# mutation check cannot follow into; these drive VolumeIdentity itself in this process,
# its mounts described by a mountinfo file of the test's own (the format of
# /proc/self/mountinfo) and an empty fstab, so each check is reached directly.


class Mounts:
    """A mountinfo file: the root file system and the volume's mount at ``point``."""

    def __init__(self, tmp_path: Path) -> None:
        self.point = tmp_path / "mnt"
        self.root = self.point / "run"
        self.root.mkdir(parents=True)
        self.file = tmp_path / "mountinfo"
        self.fstab = tmp_path / "fstab"
        self.fstab.write_text("")
        self.at(40)

    def at(self, mount_id: int, point: Optional[Path] = None) -> None:
        """The volume mounted (again) with ``mount_id``, at ``point`` (its own by default)."""
        where = point or self.point
        self.file.write_text(f"1 0 8:1 / / rw - ext4 /dev/sda1 rw\n"
                             f"{mount_id} 1 0:55 / {where} rw - nfs4 server:/export rw\n")

    def identity(self) -> VolumeIdentity:
        return VolumeIdentity(self.root, fstab=self.fstab, mountinfo=self.file)


def marker_id(root: Path) -> str:
    return (root / VOLUME_MARKER).read_text().split()[-1]


def damage(root: Path) -> None:
    """The marker overwritten in place (it is 0444; root writes it all the same)."""
    (root / VOLUME_MARKER).write_text("esi-sidecar uploader pid=1\n")


def test_a_marker_already_there_is_adopted_not_replaced(tmp_path: Path) -> None:
    mounts = Mounts(tmp_path)
    (mounts.root / VOLUME_MARKER).write_text("esi-sidecar volume 0123abcd\n")
    identity = mounts.identity()
    identity.confirm()
    assert identity.volume_id == "0123abcd" and marker_id(mounts.root) == "0123abcd"


def test_a_remount_is_said_remembered_and_the_mount_followed(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    mounts = Mounts(tmp_path)
    identity = mounts.identity()
    changes: list[Any] = []
    identity.on_change = changes.append
    identity.confirm()
    device = os.stat(mounts.root).st_dev
    assert identity.mount is not None and identity.mount.point == mounts.point
    assert identity.mount.mount_id == 40
    mounts.at(41)  # the same volume mounted again: a new mount id
    with caplog.at_level(logging.INFO, "sidecar.host.upload.identity"):
        identity.confirm()
    assert [r.getMessage() for r in caplog.records] == [
        f"{mounts.point} was mounted again (mount 41, device {device}; was 40, {device}); "
        f"its {VOLUME_MARKER} is the same"]
    assert identity.mount.mount_id == 41
    assert [c.mount.mount_id for c in changes] == [40, 41]
    assert changes[-1].volume_id == marker_id(mounts.root)
    caplog.clear()
    with caplog.at_level(logging.INFO, "sidecar.host.upload.identity"):
        identity.confirm()  # nothing new: nothing said, nothing remembered anew
    assert caplog.records == [] and len(changes) == 2


def test_a_nearer_mount_point_is_refused_naming_both(tmp_path: Path) -> None:
    mounts = Mounts(tmp_path)
    identity = mounts.identity()
    identity.confirm()
    mounts.at(42, point=mounts.root)  # another file system mounted at the folder itself
    with pytest.raises(NotTheVolume) as refused:
        identity.confirm()
    assert str(refused.value) == (
        f"destination {mounts.root} is not the volume it was: not mounted? (it is no longer "
        f"on the file system mounted at {mounts.point}, but on the one at {mounts.root})")


@pytest.mark.parametrize("confirms_before", [1, 2])
def test_a_damaged_marker_on_the_confirmed_mount_is_written_back_and_said(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, confirms_before: int) -> None:
    """After the first use (1) or after a later check (2): the mount the marker was last
    seen on is the one now, so the marker is written back from memory."""
    mounts = Mounts(tmp_path)
    identity = mounts.identity()
    for _ in range(confirms_before):
        identity.confirm()
    known = identity.volume_id
    damage(mounts.root)
    with caplog.at_level(logging.WARNING, "sidecar.host.upload.identity"):
        identity.confirm()
    assert marker_id(mounts.root) == known
    assert [r.getMessage() for r in caplog.records] == [
        f"the {VOLUME_MARKER} of {mounts.root} was overwritten; written back from the "
        "daemon's memory (the mount is the one it was)"]


def test_a_marker_that_appears_after_the_start_is_adopted_not_overwritten(
        tmp_path: Path) -> None:
    """Two hosts on one shared volume: this daemon started before the other wrote the
    marker; at its first commit it takes the other's marker, never one of its own over
    it (the other would then refuse the volume as another)."""
    mounts = Mounts(tmp_path)
    identity = mounts.identity()
    identity.start()
    assert identity.volume_id is None  # nothing there yet, nothing remembered
    (mounts.root / VOLUME_MARKER).write_text("esi-sidecar volume feedface\n")
    identity.confirm()
    assert identity.volume_id == "feedface" and marker_id(mounts.root) == "feedface"


def test_a_damaged_marker_after_a_remount_is_refused_not_written_back(tmp_path: Path) -> None:
    mounts = Mounts(tmp_path)
    identity = mounts.identity()
    identity.confirm()
    identity.confirm()  # checked on the mount it is on
    known = identity.volume_id
    assert known is not None
    mounts.at(43)  # mounted again: the damage may have come with it
    damage(mounts.root)
    with pytest.raises(NotTheVolume) as refused:
        identity.confirm()
    assert str(refused.value) == (
        f"destination {mounts.root} is not the volume it was: not mounted? (its "
        f"{VOLUME_MARKER} is damaged; the daemon's volume has id {known[:8]}..., kept in "
        "its state file)")
    assert (mounts.root / VOLUME_MARKER).read_text() == "esi-sidecar uploader pid=1\n"


def test_fstab_mount_points_refuse_only_an_unmounted_one_at_or_above_the_folder(
        tmp_path: Path) -> None:
    """fstab says what should be mounted; mountinfo what is. Refused: the nearest fstab
    point at or above the folder that is not mounted (named). Not refused: the point
    mounted, or a point elsewhere that is not mounted."""
    mounts = Mounts(tmp_path)
    outer = tmp_path  # an fstab point above the volume's, not mounted either
    elsewhere = tmp_path.parent / "elsewhere"
    mounts.fstab.write_text(f"server:/export {mounts.point} nfs4 defaults 0 0\n"
                            f"/dev/sdb1 {outer} ext4 defaults 0 2\n"
                            f"/dev/sdc1 {elsewhere} ext4 defaults 0 2\n")
    mounts.identity().start()  # the volume is mounted (mountinfo): accepted
    mounts.file.write_text("1 0 8:1 / / rw - ext4 /dev/sda1 rw\n")  # nothing mounted
    with pytest.raises(NotTheVolume) as refused:
        mounts.identity().start()
    assert str(refused.value) == (
        f"destination {mounts.root} is not the volume it was: not mounted? "
        f"({mounts.fstab} mounts {mounts.point}, which is not mounted now)")
    mounts.fstab.write_text(f"/dev/sdc1 {elsewhere} ext4 defaults 0 2\n")
    mounts.identity().start()  # only a point elsewhere is missing: not this folder's


def test_a_restart_on_another_mount_point_is_refused_naming_both(tmp_path: Path) -> None:
    mounts = Mounts(tmp_path)
    identity = mounts.identity()
    identity.confirm()
    assert identity.remembered is not None
    mounts.at(44, point=mounts.root)  # after the restart the folder is a mount of its own
    again = mounts.identity()
    again.remembered = identity.remembered
    with pytest.raises(NotTheVolume) as refused:
        again.start()
    assert str(refused.value) == (
        f"destination {mounts.root} is not the volume it was: not mounted? (it was on the "
        f"file system mounted at {mounts.point}, now it is on the one at {mounts.root})")


def test_a_marker_damaged_while_the_daemon_was_down_on_the_same_mount_is_written_back(
        tmp_path: Path) -> None:
    """A restart with no remount between (the mount remembered is the mount now): the
    damaged marker is written back from the state file's id, as within one run."""
    mounts = Mounts(tmp_path)
    identity = mounts.identity()
    identity.confirm()
    known, remembered = identity.volume_id, identity.remembered
    damage(mounts.root)
    again = mounts.identity()
    again.remembered = remembered
    again.start()
    assert again.volume_id == known and marker_id(mounts.root) == known
