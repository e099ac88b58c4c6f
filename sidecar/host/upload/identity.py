"""Proves that a volume destination is still the volume it was, before a copy counts as durable.

An unmounted volume (unmounted by hand, NFS lost, a boot that started the daemon before
the mount) leaves its mount point behind: an empty folder on the host's own disk that
takes every write and dies with the machine (issue 22, item 1). So the volume carries
its identity, the daemon remembers it, and every commit checks it again:

- ``.esi-sidecar-volume`` in the destination folder holds a random id, written once, at
  the first commit into a folder without one, on the first use ever (or adopted, from a
  folder that earlier versions filled). From then on every commit, and every "already
  complete there", needs the marker with the same id: a folder without it, or with
  another volume's, is not the volume it was.
- The file system under the folder (the nearest mount point, from
  ``/proc/self/mountinfo``) is remembered: when that mount is gone, the folder is
  refused even if a stale marker lies on the disk beneath, or another file system was
  mounted nearer to the folder.
- What is remembered (the id, the mount point, its mount id and device) is kept in the
  daemon's state file (:class:`Remembered`, ``volume_section``), so a restarted daemon
  knows it too: a missing marker, another volume's marker or another mount point after a
  restart is a refusal, not a fresh volume (issue 35, item 8). The mount id and the
  device change at every mount (a reboot, an automounter), so they tell a remount, not
  another volume. Without a state file a restarted daemon has only ``/etc/fstab``: a
  folder that it says is (or lies under) a mount point that is not mounted is refused.
- A marker that is there but damaged (overwritten in place) on the very mount this run
  confirmed is written back from memory, so one overwrite does not stop uploads for good
  (issue 35, item 3). A missing marker is never written back: that is the unmounted case.

Standard library only (restore from a volume needs no boto3).
"""

from __future__ import annotations

import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from sidecar.checkpoint.durable import fsync_path, replace_atomically
from sidecar.checkpoint.leftovers import writer_tag

__all__ = [
    "VOLUME_MARKER",
    "Mount",
    "NotTheVolume",
    "Remembered",
    "VolumeIdentity",
    "mount_now",
    "unmounted_reason",
]

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


def mount_ids(mountinfo: Path = Path("/proc/self/mountinfo")) -> Optional[dict[Path, int]]:
    """Every mount point now and the id of the mount on top there, or None when
    ``mountinfo`` cannot be read."""
    try:
        lines = mountinfo.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return None
    points: dict[Path, int] = {}
    for line in lines:  # parents first: a later line at the same point is on top
        fields = line.split()
        if len(fields) > 4 and fields[0].isdigit():
            points[Path(_unescape(fields[4]))] = int(fields[0])
    return points


def mounted_points(mountinfo: Path = Path("/proc/self/mountinfo")) -> Optional[set[Path]]:
    """Every mount point now, or None when ``mountinfo`` cannot be read."""
    points = mount_ids(mountinfo)
    return None if points is None else set(points)


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


@dataclass(frozen=True)
class Mount:
    """The file system a folder is on: its mount point, the mount's id (-1: unknown) and
    the folder's device. The id and the device are new at every mount."""

    point: Path
    mount_id: int
    device: int


def mount_now(folder: Path, mountinfo: Path = Path("/proc/self/mountinfo")) -> Mount:
    """The mount ``folder`` is on now (``OSError`` when the folder is not there)."""
    points = mount_ids(mountinfo)
    point = mount_of(folder, None if points is None else set(points))
    mount_id = -1 if points is None else points.get(point, -1)
    return Mount(point, mount_id, os.stat(folder).st_dev)


@dataclass(frozen=True)
class Remembered:
    """What the daemon knows of its volume across restarts (kept in the state file)."""

    volume_id: str
    mount: Mount


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
    """The identity of one destination folder (see the module's docstring).

    ``remembered`` is what an earlier run knew (set from the state file before
    :meth:`start`); ``on_change`` is called with the new :class:`Remembered` whenever it
    changes (the first use, a remount), before the commit that follows counts."""

    def __init__(self, root: Path, *, fstab: Path = Path("/etc/fstab"),
                 mountinfo: Path = Path("/proc/self/mountinfo")) -> None:
        self.root = root
        self.fstab = fstab
        self.mountinfo = mountinfo
        self.volume_id: Optional[str] = None  # known once read, written or remembered
        self.mount: Optional[Mount] = None  # the mount it is on since the start
        self._confirmed: Optional[Mount] = None  # the mount its marker was last checked on
        self.remembered: Optional[Remembered] = None
        self.on_change: Callable[[Remembered], None] = lambda remembered: None

    def _refuse(self, why: str) -> NotTheVolume:
        return NotTheVolume(f"destination {self.root} is not the volume it was: not "
                            f"mounted? ({why})")

    def _marker(self) -> tuple[Optional[str], str]:
        """The marker's id, or None and why: "missing" or "damaged". Opened without
        following a link; only a regular file is read."""
        try:
            handle = os.open(self.root / VOLUME_MARKER, os.O_RDONLY | os.O_NOFOLLOW
                             | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            return None, "missing"
        except OSError:  # a link (ELOOP), or unreadable
            return None, "damaged"
        try:
            if not stat.S_ISREG(os.fstat(handle).st_mode):
                return None, "damaged"
            raw = os.read(handle, 4096)
        finally:
            os.close(handle)
        text = raw.decode("utf-8", errors="replace").strip()
        if not text.startswith(_MARKER_TEXT) or not text[len(_MARKER_TEXT):]:
            return None, "damaged"
        return text[len(_MARKER_TEXT):], ""

    def read_marker(self) -> Optional[str]:
        return self._marker()[0]

    def start(self) -> None:
        """At the uploader's start: refuse an unmounted volume's place (``/etc/fstab``,
        and what an earlier run remembered), and check the marker against it."""
        reason = unmounted_reason(self.root, self.fstab, self.mountinfo)
        if reason is not None:
            raise self._refuse(reason)
        now = mount_now(self.root, self.mountinfo)
        if self.mount is None:
            if self.remembered is not None and self.remembered.mount.point != now.point:
                raise self._refuse(
                    f"it was on the file system mounted at {self.remembered.mount.point}, "
                    f"now it is on the one at {now.point}")
            self.mount = now
        if self.volume_id is None:
            self.volume_id = (self.remembered.volume_id if self.remembered is not None
                              else self.read_marker())
        if self.remembered is not None:
            self._confirmed = self._confirmed or self.remembered.mount
            self._check_marker(now)

    def confirm(self) -> None:
        """Before anything counts as durable in the folder: the mount is the one it was
        and the marker is the one known (written now on the first use ever: no marker
        there and none known)."""
        if self.mount is None:
            self.start()
        assert self.mount is not None
        now = mount_now(self.root, self.mountinfo)
        if now.point != self.mount.point:
            raise self._refuse(f"it is no longer on the file system mounted at "
                               f"{self.mount.point}, but on the one at {now.point}")
        if self.volume_id is None:
            found = self.read_marker()
            self.volume_id = found if found is not None else self._write_marker()
            self._confirmed = now
        else:
            self._check_marker(now)
        if now != self.mount:
            log.info("%s was mounted again (mount %d, device %d; was %d, %d); its %s is the "
                     "same", self.mount.point, now.mount_id, now.device, self.mount.mount_id,
                     self.mount.device, VOLUME_MARKER)
        self.mount = now
        self._remember(Remembered(self.volume_id, now))

    def _check_marker(self, now: Mount) -> None:
        assert self.volume_id is not None
        found, why = self._marker()
        if found == self.volume_id:
            self._confirmed = now
            return
        if found is not None:
            raise self._refuse(f"its {VOLUME_MARKER} names another volume")
        if why == "damaged" and now == self._confirmed:  # the very mount, not remounted
            log.warning("the %s of %s was overwritten; written back from the daemon's "
                        "memory (the mount is the one it was)", VOLUME_MARKER, self.root)
            self._write_marker(self.volume_id)
            return
        raise self._refuse(f"its {VOLUME_MARKER} is {why}; the daemon's volume has id "
                           f"{self.volume_id[:8]}..., kept in its state file")

    def _remember(self, remembered: Remembered) -> None:
        if remembered != self.remembered:
            self.remembered = remembered
            self.on_change(remembered)

    def _write_marker(self, volume_id: Optional[str] = None) -> str:
        volume_id = volume_id or os.urandom(16).hex()
        temp = f".tmp-{VOLUME_MARKER[1:]}.{writer_tag()}.{os.urandom(4).hex()}"
        replace_atomically(self.root / VOLUME_MARKER,
                           f"{_MARKER_TEXT}{volume_id}\n".encode(), temp_name=temp)
        _read_only(self.root / VOLUME_MARKER)
        fsync_path(self.root)
        log.info("marked %s as this uploader's volume (%s)", self.root, VOLUME_MARKER)
        return volume_id


def _read_only(path: Path) -> None:
    """``path`` (a file the daemon just made) set to 0444, no link followed."""
    handle = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.fchmod(handle, 0o444)
    finally:
        os.close(handle)
