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
