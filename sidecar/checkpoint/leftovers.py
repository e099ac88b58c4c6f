"""Who owns what a killed save left behind, and removing it once the owner is dead (private).

Split out of :mod:`sidecar.checkpoint.folders`, which re-exports :func:`clean_leftovers`. A save
works in hidden folders named ``.<kind>-<name>.<writer>.<token>`` next to its target:
``.tmp-`` (being written), ``.old-`` (the folder a re-save moved aside), ``.del-`` (being
pruned). The writer tag (:func:`writer_tag`) says who owns one: a hash of the host (node
name + boot id), the pid, and the process start time (pids are reused, in containers
within seconds, so a pid alone would keep a dead writer's folder forever). Standard
library only, like the training side.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import re
import shutil
import time
from pathlib import Path
from typing import Optional

from sidecar.checkpoint.durable import rename_durably
from sidecar.checkpoint.manifest import PathLike

__all__ = [
    "FOREIGN_LEFTOVER_AFTER_SECONDS",
    "clean_leftovers",
    "clean_quietly",
    "remove_path",
    "writer_tag",
]

# The checkpoint logger, not one of its own: the cleaning is part of what
# ``sidecar.checkpoint.folders`` does, and users filter and test its messages under that name.
_log = logging.getLogger("sidecar.checkpoint")

_LEFTOVER = re.compile(
    r"^\.(?P<kind>tmp|old|del)-(?P<name>.+)\."
    r"(?P<host>[0-9a-f]{8})-(?P<pid>\d{1,10})-(?P<start>\d{1,20})\.(?P<token>[0-9a-f]{8})$"
)
# Another host's leftover cannot be checked by pid; it is removed once nothing in it has
# changed for this long (a live writer keeps touching its files).
FOREIGN_LEFTOVER_AFTER_SECONDS = 3600.0


@functools.lru_cache(maxsize=1)
def _host_tag() -> str:
    try:
        boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot_id = ""
    return hashlib.sha256(f"{platform.node()}\0{boot_id}".encode()).hexdigest()[:8]


def _proc_stat(pid: int) -> Optional[tuple[str, int]]:
    """(state, start time in clock ticks) from /proc, or None where there is no /proc."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rfind(")") + 2 :].split()
    try:
        return fields[0], int(fields[19])
    except (IndexError, ValueError):
        return None


def writer_tag() -> str:
    """This process's tag, ``<host>-<pid>-<start>``, for the leftover names it creates."""
    pid = os.getpid()
    info = _proc_stat(pid)
    return f"{_host_tag()}-{pid}-{info[1] if info else 0}"


def _writer_alive(host: str, pid: int, start: int) -> Optional[bool]:
    """True or False for a writer on this host; None for another host (unknowable)."""
    if host != _host_tag():
        return None
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, owned by another user
    except (OverflowError, OSError):
        return False
    info = _proc_stat(pid)
    if info is not None:
        state, current_start = info
        if state in ("Z", "X", "x"):  # killed, waiting to be reaped
            return False
        if start and current_start != start:  # the pid was reused
            return False
    return True


def _newest_mtime(path: Path) -> float:
    newest = os.lstat(path).st_mtime
    for current, _dirs, files in os.walk(path):
        for name in files:
            try:
                newest = max(newest, os.lstat(os.path.join(current, name)).st_mtime)
            except FileNotFoundError:
                continue
    return newest


def remove_path(path: Path) -> None:
    """Remove a file or a folder tree; one already gone is not an error."""
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    except FileNotFoundError:
        pass


def clean_leftovers(
    root: PathLike, *, foreign_after_seconds: float = FOREIGN_LEFTOVER_AFTER_SECONDS
) -> list[Path]:
    """Remove what killed saves left in ``root``; returns the paths removed or restored.

    Only leftovers whose writer is dead are touched: on this host the pid is checked
    (with its start time, against pid reuse); another host's leftover (a shared mount)
    only once nothing in it changed for ``foreign_after_seconds``. A folder that a re-save had
    moved aside, whose replacement never arrived, is renamed back rather than removed,
    so a kill between the two renames never loses the checkpoint. Called by
    :class:`atomic_checkpoint` and :func:`latest_valid`.
    """
    base = Path(root)
    try:
        entries = sorted(os.scandir(base), key=lambda entry: entry.name)
    except (FileNotFoundError, NotADirectoryError):
        return []
    handled: list[Path] = []
    now = time.time()
    for entry in entries:
        match = _LEFTOVER.match(entry.name)
        if match is None:
            continue
        path = Path(entry.path)
        try:
            alive = _writer_alive(match["host"], int(match["pid"]), int(match["start"]))
            if alive is None:
                alive = now - _newest_mtime(path) < foreign_after_seconds
            if alive:
                continue
            final = base / match["name"]
            if match["kind"] == "old" and not os.path.lexists(final):
                rename_durably(path, final)
                _log.warning("restored %s: the save that was replacing it was killed", final)
                handled.append(final)
                continue
            remove_path(path)
            _log.info("removed %s, left by a killed save", path)
            handled.append(path)
        except FileNotFoundError:
            continue  # another process cleaned it first
        except OSError as exc:
            _log.warning("could not clean %s: %s", path, exc)
    return handled


def clean_quietly(root: Path) -> None:
    """:func:`clean_leftovers`, logging rather than raising when ``root`` cannot be cleaned."""
    try:
        clean_leftovers(root)
    except OSError as exc:  # e.g. a read-only mount when resuming
        _log.warning("could not clean leftovers in %s: %s", root, exc)
