"""Crash-safe writes: the project's one home for fsync, atomic replace and synced trees.

Used by everything that writes state that must survive a crash or a kill: the checkpoint
commit, restore, the daemon's state file and the Lightning callback (ARCHITECTURE.md,
"Writes that must survive a crash": temp file in the same folder, fsync, ``os.replace``,
fsync the folder). Standard library only.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import stat
from pathlib import Path
from typing import Callable, Optional, Union

__all__ = [
    "fsync_path",
    "replace_atomically",
    "sync_file",
    "sync_tree",
    "write_durably",
]

_READ_CHUNK = 8 << 20
# fsync answers these on file systems that cannot sync (some FUSE / object-store mounts,
# directories on a few network file systems): nothing more can be done there, so they
# are tolerated. Any other error (EIO, ENOSPC) means the data may be lost and is raised.
_SYNC_UNSUPPORTED = frozenset({errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS})

StrPath = Union[str, "os.PathLike[str]"]


def _fsync_fd(fd: int) -> None:
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in _SYNC_UNSUPPORTED:
            raise


def fsync_path(path: StrPath) -> None:
    """fsync a file, or a folder's entries (new names, renames)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        _fsync_fd(fd)
    finally:
        os.close(fd)


def write_durably(path: Path, data: bytes) -> None:
    """Write a new file and fsync it (the caller fsyncs the folder or renames it)."""
    with open(path, "xb") as handle:
        handle.write(data)
        handle.flush()
        _fsync_fd(handle.fileno())


def replace_atomically(path: Path, data: bytes, temp_name: str) -> None:
    """The project's crash-safe write: temp file in the same folder, fsync, os.replace,
    fsync the folder. ``temp_name`` is chosen by the caller so leftovers are recognisable."""
    temp = path.with_name(temp_name)
    try:
        write_durably(temp, data)
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            temp.unlink()
        raise
    fsync_path(path.parent)


def sync_file(path: Path, *, checksum: bool = False) -> tuple[int, Optional[str]]:
    """fsync one file; with ``checksum`` also hash it in the same pass. -> (size, sha256)."""
    with open(path, "rb", buffering=0) as handle:
        digest = None
        if checksum:
            hasher = hashlib.sha256()
            buffer = bytearray(_READ_CHUNK)
            view = memoryview(buffer)
            while True:
                count = handle.readinto(view)
                if not count:
                    break
                hasher.update(view[:count])
            digest = hasher.hexdigest()
        _fsync_fd(handle.fileno())
        return os.fstat(handle.fileno()).st_size, digest


def _sync_plain(path: Path) -> None:
    sync_file(path)


def sync_tree(path: StrPath, *, on_file: Callable[[Path], None] = _sync_plain) -> None:
    """fsync every regular file under ``path`` (or hand it to ``on_file``, which must
    fsync it), then every folder, deepest first, so each folder is synced after the
    entries inside it. Files and sub-folders are visited in sorted order. A plain file
    is just fsynced.

    Symbolic links and special files are not followed: a link could point outside the
    tree and dangle after a rename.
    """
    root = Path(path)
    if not root.is_dir():
        fsync_path(root)
        return
    folders: list[Path] = []
    for current, dirnames, filenames in os.walk(root):
        dirnames.sort()
        base = Path(current)
        folders.append(base)
        for filename in sorted(filenames):
            full = base / filename
            if stat.S_ISREG(os.lstat(full).st_mode):
                on_file(full)
    for folder in reversed(folders):
        fsync_path(folder)
