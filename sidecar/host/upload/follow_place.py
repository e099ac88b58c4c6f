"""The follower's writes into the job's checkpoint folder, which is hostile input (the
daemon is root, the folder the job's): ARCHITECTURE.md, "Trust boundary".

- Nothing is written through a path that runs through the job's folder. The follower,
  and ``esi-sidecar restore`` (``volume.commit_into``), build each copy in a private
  folder made there (``.tmp-follow.<random>``: made by ``mkdir`` relative to the folder's
  fd, opened ``O_NOFOLLOW``, checked to be ours and 0700, so the job, another user, can
  neither read nor write into it). Below it, paths go through ``/proc/self/fd/<fd>`` of
  that open folder, which no rename in the job's folder can redirect (the job may rename
  the folder away and put a link in its place: nothing goes through the name); so the
  restore's own copy and download code writes there unchanged.
- Every file and folder of a copy is handed to the folder's owner (``fchown`` to its
  ``st_uid``/``st_gid``; the follower's files 0444 as on a volume: a file may be a hard
  link shared with the previous copy) before it becomes visible, by one
  ``renameat2(RENAME_NOREPLACE)``: never over an entry the job made. The ``latest``
  pointer is created the same way and replaced only while it is the one the follower
  made (the restore: the one it found).
- The private folder's name matches neither a save in progress (``stream._TEMP``, which
  the uploader sends early) nor a killed save's leftover (``clean_leftovers``): the
  uploader never sends the follower's copy before it is complete, and the job's
  ``latest_valid`` never looks into it. A killed daemon's leftovers are removed at the next
  start (:func:`clean_own`).
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import os
import re
import shutil
import stat
from pathlib import Path
from typing import Optional

from sidecar.checkpoint.durable import fsync_fd, rename_durably
from sidecar.checkpoint.manifest import FileEntry, Invalid, open_under

__all__ = ["DELETING", "PRIVATE", "Private", "clean_own", "hand_over", "is_own_name",
           "link_unchanged", "no_replace", "open_folder", "open_target", "place_latest",
           "rename_no_replace", "retire"]

PRIVATE = ".tmp-follow."  # the follower's building folders
DELETING = ".del-follow."  # a previous copy on its way out
_OWN = re.compile(r"^\.(?:tmp|del)-follow\.[0-9a-f]{16}$")
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_RENAME_NOREPLACE = 1
_CHUNK = 4 << 20


def is_own_name(name: str) -> bool:
    return _OWN.match(name) is not None


def open_folder(path: Path) -> int:
    """The checkpoint folder, opened without following a link at its last component."""
    return os.open(path, _DIR)


def open_target(path: Path) -> int:
    """A folder named by the operator (``restore --to``), opened as :func:`open_folder`; a
    link there is followed only when root or this user made it: a link the job made in
    its own parent folder could aim anywhere."""
    try:
        return open_folder(path)
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENOTDIR) or not os.path.islink(path):
            raise
    if os.lstat(path).st_uid not in (0, os.geteuid()):
        raise PermissionError(errno.EPERM, "a symbolic link another user made", str(path))
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)


def rename_no_replace(src_fd: int, src: str, dst_fd: int, dst: str) -> None:
    """``renameat2(..., RENAME_NOREPLACE)``: FileExistsError when ``dst`` exists. Where the
    call or the file system lacks it, a check then ``renameat`` (a folder can then replace
    only an empty folder made in between)."""
    libc = ctypes.CDLL(None, use_errno=True)
    call = getattr(libc, "renameat2", None)
    if call is not None:
        call.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p,
                         ctypes.c_uint]
        if call(src_fd, os.fsencode(src), dst_fd, os.fsencode(dst), _RENAME_NOREPLACE) == 0:
            return
        code = ctypes.get_errno()
        if code not in (errno.ENOSYS, errno.EINVAL):
            raise OSError(code, os.strerror(code), dst)
    try:
        os.lstat(dst, dir_fd=dst_fd)
    except FileNotFoundError:
        os.rename(src, dst, src_dir_fd=src_fd, dst_dir_fd=dst_fd)
        return
    raise FileExistsError(errno.EEXIST, "exists", dst)


def no_replace(src: str, dst: str, *, src_dir_fd: int, dst_dir_fd: int) -> None:
    """:func:`rename_no_replace` called as ``os.rename`` is (``durable.rename_durably``)."""
    rename_no_replace(src_dir_fd, src, dst_dir_fd, dst)


class Private:
    """One building folder in the job's folder; ``path`` reaches it through the fd."""

    def __init__(self, root_fd: int) -> None:
        self.root_fd = root_fd
        self.name = PRIVATE + os.urandom(8).hex()
        os.mkdir(self.name, 0o700, dir_fd=root_fd)
        self.fd = os.open(self.name, _DIR, dir_fd=root_fd)
        found = os.fstat(self.fd)
        if found.st_uid != os.geteuid() or found.st_mode & 0o077:
            os.close(self.fd)
            raise PermissionError(errno.EPERM, "the private folder was replaced", self.name)
        self.path = Path(f"/proc/self/fd/{self.fd}")

    def discard(self) -> None:
        """Remove the folder (no link followed) if its name still holds it."""
        try:
            mine = os.fstat(self.fd).st_ino
            if os.lstat(self.name, dir_fd=self.root_fd).st_ino == mine:
                shutil.rmtree(self.name, dir_fd=self.root_fd)
        except OSError:
            pass
        finally:
            os.close(self.fd)


def _same_file(handle: int, entry: FileEntry) -> bool:
    found = os.fstat(handle)
    if not stat.S_ISREG(found.st_mode) or found.st_size != entry.size:
        return False
    digest = hashlib.sha256()
    while True:
        chunk = os.read(handle, _CHUNK)
        if not chunk:
            break
        digest.update(chunk)
    return digest.hexdigest() == entry.sha256


def link_unchanged(previous_fd: int, folder: Path, entries: tuple[FileEntry, ...]) -> int:
    """Hard-link into ``folder`` (private) each of ``entries`` from the previous copy,
    opened without following links and checked (regular, size, sha256) before the very
    inode opened is linked (``/proc/self/fd``). Returns the bytes linked; Invalid when
    one no longer matches (then it is fetched)."""
    linked = 0
    for entry in entries:
        handle = open_under(previous_fd, entry.path)
        try:
            if not _same_file(handle, entry):
                raise Invalid(f"{entry.path} of the previous copy changed")
            target = folder / entry.path
            target.parent.mkdir(parents=True, exist_ok=True)
            # The parent by its fd: a new name through /proc/self/fd answers EXDEV.
            parent = os.open(target.parent, _DIR)
            try:
                os.link(f"/proc/self/fd/{handle}", target.name, dst_dir_fd=parent,
                        follow_symlinks=True)
            finally:
                os.close(parent)
        finally:
            os.close(handle)
        linked += entry.size
    return linked


def _give(handle: int, uid: int, gid: int) -> None:
    """``handle``'s file given to ``uid``:``gid`` (nothing to do when it is theirs: a user
    restoring into their own folder need not be in its group)."""
    found = os.fstat(handle)
    if (found.st_uid, found.st_gid) != (uid, gid):
        os.fchown(handle, uid, gid)


def hand_over(folder: Path, uid: int, gid: int, *, file_mode: int = 0o444) -> None:
    """Every file (``file_mode``) and folder (0755) of ``folder`` (private) given to
    ``uid``:``gid``, opened without following a link; folders fsynced (the links are
    entries too)."""
    for current, _dirnames, filenames in os.walk(folder, topdown=False):
        for filename in filenames:
            handle = os.open(os.path.join(current, filename), os.O_RDONLY | os.O_NOFOLLOW)
            try:
                _give(handle, uid, gid)
                os.fchmod(handle, file_mode)
            finally:
                os.close(handle)
        handle = os.open(current, _DIR)
        try:
            _give(handle, uid, gid)
            os.fchmod(handle, 0o755)
            fsync_fd(handle)
        finally:
            os.close(handle)


def place_latest(private: Private, root_fd: int, name: str, uid: int, gid: int,
                 ours: Optional[int]) -> Optional[int]:
    """``latest`` naming ``name``: created when there is none, replaced only while it is
    the one the follower made (inode ``ours``). Returns the inode it made, or None."""
    handle = os.open("latest", _NEW_FILE, 0o644, dir_fd=private.fd)
    try:
        os.write(handle, f"{name}\n".encode())
        fsync_fd(handle)
        _give(handle, uid, gid)
        made = os.fstat(handle).st_ino
    finally:
        os.close(handle)
    try:
        rename_durably("latest", "latest", src_dir_fd=private.fd, dst_dir_fd=root_fd,
                       rename=no_replace)
    except FileExistsError:
        try:
            there = os.lstat("latest", dir_fd=root_fd).st_ino
        except FileNotFoundError:
            there = None
        if ours is None or there != ours:
            return None  # the job's pointer: left alone
        rename_durably("latest", "latest", src_dir_fd=private.fd, dst_dir_fd=root_fd,
                       rename=os.replace)
    return made


def retire(root_fd: int, name: str, inode: int) -> None:
    """Remove the follower's previous copy ``name`` if the name still holds it: renamed
    out of sight first, so no half-deleted checkpoint is ever visible."""
    try:
        found = os.lstat(name, dir_fd=root_fd)
    except FileNotFoundError:
        return
    if found.st_ino != inode or not stat.S_ISDIR(found.st_mode):
        return
    hidden = DELETING + os.urandom(8).hex()
    rename_no_replace(root_fd, name, root_fd, hidden)
    moved = os.lstat(hidden, dir_fd=root_fd)  # the job may have swapped it after the check
    if moved.st_ino != inode or not stat.S_ISDIR(moved.st_mode):
        rename_no_replace(root_fd, hidden, root_fd, name)  # the job's entry: given back
        return
    shutil.rmtree(hidden, dir_fd=root_fd)


def clean_own(root_fd: int) -> int:
    """Remove what a killed follower left (its building and deleting folders)."""
    removed = 0
    for entry in os.scandir(root_fd):
        if is_own_name(entry.name) and entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.name, dir_fd=root_fd, ignore_errors=True)
            removed += 1
    return removed
