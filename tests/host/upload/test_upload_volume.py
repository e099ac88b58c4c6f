"""A mounted network volume as the destination (``--upload-to file:///...``): the real daemon's
uploader copies complete checkpoints there with the S3 guarantees (files fsynced, manifest
last, atomic rename), a killed copy is never taken for a checkpoint, the bandwidth cap
holds, and ``esi-sidecar restore --from file:///...`` brings the newest one back.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from daemon_harness import get_json, serve_daemon, wait_for

from sidecar.checkpoint.folders import atomic_checkpoint, latest_valid
from sidecar.host.upload.volume import EXIT_NOTHING, VolumeDestination, restore_from_volume
from sidecar.train.client import SidecarClient

MIB = 1 << 20
REPO = Path(__file__).resolve().parents[3]


def make_checkpoint(root: Path, step: int, size: int) -> None:
    with atomic_checkpoint(root, step) as folder:
        (folder / "model.pt").write_bytes(os.urandom(size))
        (folder / "sub").mkdir()
        (folder / "sub" / "rng.json").write_text('{"seed": 1}')


def volume_settings(local: Path, volume: Path, **extra: object) -> dict[str, object]:
    return {"sources": ("static",), "expires_at": str(time.time() + 3600),
            "upload_from": local, "upload_to": volume.as_uri(), "upload_scan_interval": 0.2,
            **extra}


def test_the_daemon_copies_checkpoints_to_a_volume_and_restore_brings_them_back(
    tmp_path: Path,
) -> None:
    local, volume, fresh = tmp_path / "local", tmp_path / "volume", tmp_path / "fresh"
    local.mkdir()
    volume.mkdir()
    make_checkpoint(local, 100, 3 * MIB)
    started = time.monotonic()
    with serve_daemon(**volume_settings(local, volume, upload_max_bandwidth=2 * MIB)) as daemon:
        client = SidecarClient(daemon.url, timeout=5)
        wait_for(lambda: client.last_durable_step() == 100, timeout=30)
        took = time.monotonic() - started
        status, body = get_json(daemon.url + "/v1/uploads")
        assert status == 200 and body["destination"] == volume.as_uri()
        expiry = get_json(daemon.url + "/v1/expiry")[1]
        assert expiry["upload_status"] == "ok" and expiry["upload_seconds"] > 0
    assert took >= 3 / 2 * 0.8, took  # 3 MiB at 2 MiB/s
    copied = latest_valid(volume, verify_checksums=True)  # laid out like a checkpoint root
    assert copied is not None and copied.step == 100
    assert (copied.path / "MANIFEST.json").read_bytes() == (
        local / copied.name / "MANIFEST.json").read_bytes()
    assert not [p for p in volume.iterdir() if p.name.startswith(".tmp-")]

    # The next machine: the local disk is gone; restore from the volume.
    result = subprocess.run(
        [sys.executable, "-m", "sidecar.cli", "restore", "--from", volume.as_uri(),
         "--to", str(fresh)], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert result.returncode == 0, result.stderr
    assert f"restored {copied.name} (step 100" in result.stdout
    restored = latest_valid(fresh, verify_checksums=True)
    assert restored is not None and restored.step == 100
    original = local / copied.name / "model.pt"
    assert (restored.path / "model.pt").read_bytes() == original.read_bytes()
    assert (fresh / "latest").read_text().strip() == copied.name
    again = restore_from_volume(volume, fresh)
    assert again.already_present is True


def test_restore_from_a_volume_errors(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    nothing = subprocess.run(
        [sys.executable, "-m", "sidecar.cli", "restore", "--from", empty.as_uri(),
         "--to", str(tmp_path / "to")], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert nothing.returncode == EXIT_NOTHING and "no complete checkpoint" in nothing.stderr
    missing = subprocess.run(
        [sys.executable, "-m", "sidecar.cli", "restore", "--from",
         (tmp_path / "not-mounted").as_uri(), "--to", str(tmp_path / "to")],
        capture_output=True, text=True, cwd=REPO, timeout=60)
    assert missing.returncode == 1 and "is the volume mounted?" in missing.stderr
    relative = subprocess.run(
        [sys.executable, "-m", "sidecar.cli", "restore", "--from", "file://host/x",
         "--to", str(tmp_path / "to")], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert relative.returncode == 2 and "invalid --from" in relative.stderr


def test_a_volume_that_is_not_mounted_is_degraded_and_nothing_is_written(
    tmp_path: Path,
) -> None:
    local, volume = tmp_path / "local", tmp_path / "mnt" / "share"
    local.mkdir()
    make_checkpoint(local, 1, 10)
    with serve_daemon(**volume_settings(local, volume)) as daemon:
        wait_for(lambda: get_json(daemon.url + "/v1/uploads")[1]["degraded"], timeout=20)
        body = get_json(daemon.url + "/v1/uploads")[1]
        assert "not found (not mounted?)" in body["error"]
        assert get_json(daemon.url + "/v1/expiry")[1]["upload_status"] == "degraded"
        assert get_json(daemon.url + "/healthz")[0] == 200
    assert not volume.exists()  # the uploader never creates it on the host's own disk


# A copy killed half-way (SIGKILL): nothing under the checkpoint's name, and the leftover
# is removed by the next uploader's start on the volume.
_KILLED_COPY = textwrap.dedent("""
    import sys
    from pathlib import Path
    from sidecar.host.upload.volume import copy_checkpoint
    from sidecar.checkpoint.folders import latest_valid
    local, volume = Path(sys.argv[1]), Path(sys.argv[2])
    info = latest_valid(local)
    raw = (info.path / "MANIFEST.json").read_bytes()
    def progress(count):
        print("copying", flush=True)
    copy_checkpoint(info, raw, volume, on_progress=progress, max_bandwidth=1 << 20)
""")


def test_a_copy_killed_half_way_is_never_a_checkpoint(tmp_path: Path) -> None:
    local, volume = tmp_path / "local", tmp_path / "volume"
    local.mkdir()
    volume.mkdir()
    make_checkpoint(local, 7, 8 * MIB)  # 8 s at 1 MiB/s: killed long before the end
    process = subprocess.Popen([sys.executable, "-c", _KILLED_COPY, str(local), str(volume)],
                               stdout=subprocess.PIPE, text=True, cwd=REPO)
    assert process.stdout is not None and process.stdout.readline().strip() == "copying"
    process.send_signal(signal.SIGKILL)
    process.wait(10)
    names = [p.name for p in volume.iterdir()]
    assert len(names) == 1 and names[0].startswith(".tmp-step_00000007.")
    assert latest_valid(volume, clean=False) is None
    VolumeDestination(volume).prepare(time.time())  # the dead writer's leftover goes
    assert list(volume.iterdir()) == []


def test_bad_destination_urls_stop_start_up() -> None:
    from sidecar.host.settings import ConfigError, load_settings

    for bad in ("file://server/share", "file:///", "ftp://x/y", "mnt/share", "/"):
        with pytest.raises(ConfigError, match="--upload-to"):
            load_settings({"upload_to": bad, "upload_from": "/tmp"}, environ={})
    parsed = load_settings({"upload_to": "file:///mnt/share/run-42/", "upload_from": "/tmp"},
                           environ={})
    assert parsed.upload_to == "file:///mnt/share/run-42"
    # An absolute path is that folder, as restore --from takes it (issue 39).
    plain = load_settings({"upload_to": "/mnt/share/run-42", "upload_from": "/tmp"}, environ={})
    assert plain.upload_to == "file:///mnt/share/run-42"


def test_restore_takes_a_plain_path_as_the_volumes_folder(tmp_path: Path) -> None:
    """``restore --from /mnt/share/run`` as typed, no file:// (issue 39: it was refused)."""
    volume, fresh = tmp_path / "volume", tmp_path / "fresh"
    make_checkpoint(volume, 7, 64 * 1024)  # laid out as the uploader lays out a volume
    result = subprocess.run(
        [sys.executable, "-m", "sidecar.cli", "restore", "--from", str(volume),
         "--to", str(fresh)], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert result.returncode == 0, result.stderr
    restored = latest_valid(fresh, verify_checksums=True)
    assert restored is not None and restored.step == 7
    relative = subprocess.run(
        [sys.executable, "-m", "sidecar.cli", "restore", "--from", "share/run",
         "--to", str(fresh)], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert relative.returncode == 2 and "invalid --from" in relative.stderr
