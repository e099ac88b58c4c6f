"""Crash-safe writes: the project's one home for fsync, durable renames, atomic replace and
synced trees (every ``os.fsync`` in ``sidecar/`` is here: ``fsync_fd``, ``fsync_path``,
``rename_durably``).

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
    "fsync_fd",
    "fsync_path",
    "rename_durably",
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


def fsync_fd(fd: int) -> None:
    """fsync an open file or folder (errors of file systems that cannot sync tolerated)."""
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in _SYNC_UNSUPPORTED:
            raise


def fsync_path(path: StrPath) -> None:
    """fsync a file, or a folder's entries (new names, renames)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        fsync_fd(fd)
    finally:
        os.close(fd)


def _no_hook() -> None:
    pass


def rename_durably(
    src: StrPath,
    dst: StrPath,
    *,
    src_dir_fd: Optional[int] = None,
    dst_dir_fd: Optional[int] = None,
    rename: Callable[..., None] = os.rename,
    undo: Callable[[], None] = _no_hook,
    after_rename: Callable[[], None] = _no_hook,
) -> None:
    """The project's durable rename: ``src`` renamed to ``dst``, then ``dst``'s folder
    fsynced (``dst_dir_fd`` when given: the names are then relative to the fds, as
    ``os.rename`` takes them, and no path is opened again; else ``dst``'s parent).

    ``rename`` is called as ``rename(src, dst, src_dir_fd=, dst_dir_fd=)`` (``os.replace``
    to replace a file, a no-replace rename for a hostile folder); ``undo`` runs when the
    rename fails, before the error goes on (a folder moved aside is moved back);
    ``after_rename`` runs between the rename and the fsync (a crash point for tests)."""
    try:
        rename(src, dst, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd)
    except BaseException:
        undo()
        raise
    after_rename()
    if dst_dir_fd is not None:
        fsync_fd(dst_dir_fd)
    else:
        fsync_path(os.path.dirname(os.fspath(dst)) or ".")


def write_durably(path: Path, data: bytes) -> None:
    """Write a new file and fsync it (the caller fsyncs the folder or renames it)."""
    with open(path, "xb") as handle:
        handle.write(data)
        handle.flush()
        fsync_fd(handle.fileno())


def replace_atomically(path: Path, data: bytes, temp_name: str) -> None:
    """The project's crash-safe write: temp file in the same folder, fsync, os.replace,
    fsync the folder. ``temp_name`` is chosen by the caller so leftovers are recognisable."""
    temp = path.with_name(temp_name)

    def remove_temp() -> None:
        with contextlib.suppress(FileNotFoundError):
            temp.unlink()

    try:
        write_durably(temp, data)
    except BaseException:
        remove_temp()
        raise
    rename_durably(temp, path, rename=os.replace, undo=remove_temp)


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
        fsync_fd(handle.fileno())
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
