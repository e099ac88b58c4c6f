"""The volume's section of the state file: what the daemon knows of its volume (the
marker's id, the mount it is on), so a restarted daemon refuses a folder that is not that
volume instead of taking it for a fresh one (issue 35, item 8). ``sidecar.host.statefile``
reads and writes the file; ``identity.VolumeIdentity`` decides with what is kept here.

One entry per destination folder, keyed by its path: a daemon pointed at another folder
and back still knows the first. Entries of other folders are kept as they were loaded,
at most MAX_FOLDERS of them.
"""

from __future__ import annotations

import re
import reprlib
from pathlib import Path
from typing import Any, Callable

from sidecar.host.upload.identity import Mount, Remembered, VolumeIdentity

__all__ = ["MAX_FOLDERS", "VolumeSection"]

MAX_FOLDERS = 16  # other destination folders remembered besides the one in use
_VOLUME_ID = re.compile(r"^[0-9a-f]{8,64}$")
_FIELDS = {"volume_id", "mount_point", "mount_id", "device"}


class VolumeSection:
    """``"volume"``: the :class:`~sidecar.host.upload.identity.Remembered` identity of each
    destination folder. Optional: a bad one is ignored with one log line (the daemon then
    knows only ``/etc/fstab``, as before it kept anything)."""

    name = "volume"
    what = "the volume's identity"
    required = False

    def __init__(self, identity: VolumeIdentity, on_change: Callable[[], None]) -> None:
        """``on_change``: write the state now (the identity is on disk before the commit
        that established it counts)."""
        self._identity = identity
        self._others: dict[str, dict[str, Any]] = {}
        identity.on_change = lambda remembered: on_change()

    def dump(self) -> dict[str, Any]:
        entries = dict(self._others)
        remembered = self._identity.remembered
        if remembered is not None:
            entries[str(self._identity.root)] = _dumped(remembered)
        return entries

    def load(self, section: Any) -> None:
        """All or nothing: one bad entry refuses the section (ValueError naming it)."""
        entries = _parse(section)
        mine = entries.pop(str(self._identity.root), None)
        others = list(entries.items())[-MAX_FOLDERS:]
        self._others = {folder: _dumped(remembered) for folder, remembered in others}
        if mine is not None and self._identity.remembered is None:
            self._identity.remembered = mine


def _dumped(remembered: Remembered) -> dict[str, Any]:
    return {"volume_id": remembered.volume_id, "mount_point": str(remembered.mount.point),
            "mount_id": remembered.mount.mount_id, "device": remembered.mount.device}


def _parse(section: Any) -> dict[str, Remembered]:
    if not isinstance(section, dict):
        raise ValueError("volume must be an object")
    entries = {}
    for folder, entry in section.items():
        if not folder.startswith("/") or not isinstance(entry, dict):
            raise ValueError(f"volume: {_shown(folder)} needs an absolute path and an object")
        unknown = set(entry) - _FIELDS
        if unknown:
            raise ValueError(f"volume {folder}: unknown field(s) {', '.join(sorted(unknown))}")
        volume_id, point = entry.get("volume_id"), entry.get("mount_point")
        if not isinstance(volume_id, str) or not _VOLUME_ID.match(volume_id):
            raise ValueError(f"volume {folder}.volume_id is not an id: {_shown(volume_id)}")
        if not isinstance(point, str) or not point.startswith("/"):
            raise ValueError(f"volume {folder}.mount_point is not a path: {_shown(point)}")
        mount = Mount(Path(point), _number(folder, entry, "mount_id"),
                      _number(folder, entry, "device"))
        entries[folder] = Remembered(volume_id, mount)
    return entries


def _number(folder: str, entry: dict[str, Any], field: str) -> int:
    value = entry.get(field)
    if isinstance(value, bool) or not isinstance(value, int) or not -1 <= value < 2**64:
        raise ValueError(f"volume {folder}.{field} is not a number: {_shown(value)}")
    return value


def _shown(value: Any) -> str:
    return reprlib.repr(value)
