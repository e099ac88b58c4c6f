"""Proves that a volume destination is still the volume it was, before a copy counts as durable.

An unmounted volume (unmounted by hand, NFS lost, a boot that started the daemon before
the mount) leaves its mount point behind: an empty folder on the host's own disk that
takes every write and dies with the machine (issue 22, item 1). So the volume carries
its identity, and every commit checks it again:

- ``.esi-sidecar-volume`` in the destination folder holds a random id, written once, at
  the first commit into a folder without one (or the first use of a folder that earlier
  versions filled). From then on every commit, and every "already complete there",
  needs the marker with the same id: a folder without it is not the volume it was.
- The file system under the folder is remembered at start (the nearest mount point, from
  ``/proc/self/mountinfo``): when that mount is gone, the folder is refused even if a
  stale marker lies on the disk beneath.
- A restarted daemon knows nothing of the last run, so at start a folder that
  ``/etc/fstab`` says is (or lies under) a mount point that is not mounted is refused.

Standard library only (restore from a volume needs no boto3).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Optional

from sidecar.checkpoint.durable import fsync_path, replace_atomically
from sidecar.checkpoint.leftovers import writer_tag

__all__ = ["VOLUME_MARKER", "NotTheVolume", "VolumeIdentity", "unmounted_reason"]

log = logging.getLogger("sidecar.host.upload.identity")

VOLUME_MARKER = ".esi-sidecar-volume"
_MARKER_TEXT = "esi-sidecar volume "  # then the id


class NotTheVolume(Exception):
    """The destination folder is not (or no longer) the volume it was: one line."""


def _unescape(field: str) -> str:
    """fstab and mountinfo write a space as \\040, a tab as \\011, ..."""
    out, index = [], 0
    while index < len(field):
        if field[index] == "\\" and field[index + 1:index + 4].isdigit():
            out.append(chr(int(field[index + 1:index + 4], 8)))
            index += 4
        else:
            out.append(field[index])
            index += 1
    return "".join(out)


def mounted_points(mountinfo: Path = Path("/proc/self/mountinfo")) -> Optional[set[Path]]:
    """Every mount point now, or None when ``mountinfo`` cannot be read."""
    try:
        lines = mountinfo.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return None
    return {Path(_unescape(line.split()[4])) for line in lines if len(line.split()) > 4}


def fstab_points(fstab: Path) -> set[Path]:
    """The mount points ``fstab`` configures (swap and pseudo entries left out)."""
    try:
        lines = fstab.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return set()
    points = set()
    for line in lines:
        fields = line.split()
        if len(fields) < 2 or fields[0].startswith("#") or not fields[1].startswith("/"):
            continue
        points.add(Path(_unescape(fields[1])))
    return points


def mount_of(folder: Path, mounted: Optional[set[Path]]) -> Path:
    """The nearest mount point at or above ``folder`` (an absolute, resolved path)."""
    for candidate in (folder, *folder.parents):
        if (mounted is not None and candidate in mounted) or os.path.ismount(candidate):
            return candidate
    return Path("/")


def unmounted_reason(folder: Path, fstab: Path = Path("/etc/fstab"),
                     mountinfo: Path = Path("/proc/self/mountinfo")) -> Optional[str]:
    """Why ``folder`` looks like the empty place of a volume that is not mounted (a mount
    point ``fstab`` configures at or above it, below the mount it is on now), or None."""
    mounted = mounted_points(mountinfo)
    current = mount_of(folder, mounted)
    for point in sorted(fstab_points(fstab), key=lambda p: len(p.parts), reverse=True):
        if point != current and (point == folder or point in folder.parents) \
                and current in point.parents:
            return f"{fstab} mounts {point}, which is not mounted now"
    return None


class VolumeIdentity:
    """The identity of one destination folder (see the module's docstring)."""

    def __init__(self, root: Path, *, fstab: Path = Path("/etc/fstab"),
                 mountinfo: Path = Path("/proc/self/mountinfo")) -> None:
        self.root = root
        self.fstab = fstab
        self.mountinfo = mountinfo
        self.volume_id: Optional[str] = None  # known once read or written
        self.mount: Optional[Path] = None  # the mount it was on at start

    def _refuse(self, why: str) -> NotTheVolume:
        return NotTheVolume(f"destination {self.root} is not the volume it was: not "
                            f"mounted? ({why})")

    def read_marker(self) -> Optional[str]:
        try:
            with open(self.root / VOLUME_MARKER, "rb") as handle:
                text = handle.read(4096).decode("utf-8", errors="replace").strip()
        except FileNotFoundError:
            return None
        if not text.startswith(_MARKER_TEXT) or not text[len(_MARKER_TEXT):]:
            return None
        return text[len(_MARKER_TEXT):]

    def start(self) -> None:
        """At the uploader's start: remember the mount, refuse an unmounted volume's place."""
        reason = unmounted_reason(self.root, self.fstab, self.mountinfo)
        if reason is not None:
            raise self._refuse(reason)
        if self.mount is None:
            self.mount = mount_of(self.root, mounted_points(self.mountinfo))
        if self.volume_id is None:
            self.volume_id = self.read_marker()

    def confirm(self) -> None:
        """Before anything counts as durable in the folder: the mount is the one of the
        start and the marker is the one seen before (written now when the folder has
        none and none was seen: the first commit, or a folder an earlier version filled)."""
        if self.mount is None:
            self.start()
        now = mount_of(self.root, mounted_points(self.mountinfo))
        if now != self.mount:
            raise self._refuse(f"the file system mounted at {self.mount} at start is gone")
        found = self.read_marker()
        if self.volume_id is None:
            self.volume_id = found if found is not None else self._write_marker()
        elif found is None:
            raise self._refuse(f"its {VOLUME_MARKER} is missing")
        elif found != self.volume_id:
            raise self._refuse(f"its {VOLUME_MARKER} names another volume")

    def _write_marker(self) -> str:
        volume_id = os.urandom(16).hex()
        replace_atomically(self.root / VOLUME_MARKER,
                           f"{_MARKER_TEXT}{volume_id}\n".encode(),
                           temp_name=f".tmp-{VOLUME_MARKER[1:]}.{writer_tag()}.{volume_id[:8]}")
        fsync_path(self.root)
        log.info("marked %s as this uploader's volume (%s)", self.root, VOLUME_MARKER)
        return volume_id
