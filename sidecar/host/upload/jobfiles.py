"""The one way the daemon reads a file the training job wrote (issue 35, item 5).

The job's folders are hostile input and the daemon runs as root, so a checkpoint file is
opened relative to directory descriptors, from the upload-from root down, with
``O_NOFOLLOW`` at every component (``manifest.open_under``), and is read only when what
was opened is

- a regular file (no link, FIFO, device),
- with one link (``st_nlink == 1``): a hard link to a file elsewhere would let the job
  upload a file it cannot read itself, and
- owned by the owner of the upload-from root, or readable by anyone (``S_IROTH``): a file
  the owner of that folder could read anyway. Group read is not enough (the owner's
  groups are not looked up).

Anything else raises :class:`Refused`, an ``Invalid`` whose message names the file
(control characters escaped): the checkpoint is not made durable. The root itself is
the daemon's configuration and is opened as given.

The one thing the daemon writes into a job's folder is its pin, ``.uploading`` (issue 35,
item 1): created with ``O_CREAT | O_EXCL | O_NOFOLLOW`` relative to the folder's
descriptor, never through a path, so a link planted under that name is never followed.
When an entry of that name is there already (the job's, a link, anything) it is left
as it is and nothing is written: the training side's retention already keeps a folder
that has any entry of that name (``folders.prune``), and the daemon's own retention keeps
what its tracker has not settled. A pin is removed only while the entry is still the
file this run created (same device and inode), with ``unlink(name, dir_fd=...)``, which
never follows a link.
"""

from __future__ import annotations

import errno
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from sidecar.checkpoint.manifest import (
    MAX_MANIFEST_BYTES,
    UPLOADING_MARKER,
    Invalid,
    open_under,
    read_at_most,
)
from sidecar.host.logs import printable

__all__ = ["Pin", "Refused", "clear_stale_pin", "open_job_file", "pin", "read_job_file",
           "unpin"]

_DIRECTORY = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)
_NO_FOLLOW_DIRECTORY = _DIRECTORY | getattr(os, "O_NOFOLLOW", 0)


_MARKER_MODE = 0o644  # the job's own retention must see it (it only looks for the name)
_MARKER_MOST = 4096  # bytes of a marker read back: the daemon's are one short line


class Refused(Invalid):
    """A job's file the daemon must not read: the reason, naming the file."""


@dataclass(frozen=True)
class Pin:
    """The ``.uploading`` file this run created in ``folder``."""

    folder: Path
    device: int
    inode: int


def _open_folder(folder: Path) -> int:
    """``folder`` opened as a directory below its parent, not through a link."""
    folder = Path(folder)
    root = os.open(folder.parent, _DIRECTORY)
    try:
        return os.open(folder.name, _NO_FOLLOW_DIRECTORY, dir_fd=root)
    finally:
        os.close(root)


def pin(folder: Path, text: str) -> tuple[Optional[Pin], str]:
    """Create ``folder/.uploading`` holding ``text``. Returns the pin (None when nothing
    was created) and what happened, for the log."""
    try:
        directory = _open_folder(folder)
    except OSError as exc:
        return None, f"could not open {printable(str(folder))}: {exc.strerror}"
    try:
        flags = (os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
                 | getattr(os, "O_CLOEXEC", 0))
        try:
            handle = os.open(UPLOADING_MARKER, flags, _MARKER_MODE, dir_fd=directory)
        except FileExistsError:
            return None, (f"{printable(folder.name)}/{UPLOADING_MARKER} is there already; "
                          "left as it is (it pins the folder), nothing written")
        except OSError as exc:
            return None, f"could not pin {printable(str(folder))}: {exc.strerror}"
        try:
            os.write(handle, text.encode("utf-8"))
            found = os.fstat(handle)
        finally:
            os.close(handle)
    finally:
        os.close(directory)
    return Pin(folder, found.st_dev, found.st_ino), "pinned"


def unpin(done: Pin) -> Optional[str]:
    """Remove the pin if the entry is still the file :func:`pin` created. Returns why
    it was not removed (for the log), or None."""
    try:
        directory = _open_folder(done.folder)
    except FileNotFoundError:
        return None  # the folder went away (pruned, re-saved)
    except OSError as exc:
        return f"could not open {printable(str(done.folder))}: {exc.strerror}"
    try:
        found = os.lstat(UPLOADING_MARKER, dir_fd=directory)
        if (found.st_dev, found.st_ino) != (done.device, done.inode):
            return None  # not ours any more: someone else's entry stays
        os.unlink(UPLOADING_MARKER, dir_fd=directory)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"could not remove {printable(done.folder.name)}/{UPLOADING_MARKER}: " \
            f"{exc.strerror}"
    finally:
        os.close(directory)
    return None


def clear_stale_pin(folder: Path, text: str) -> bool:
    """Remove ``folder/.uploading`` when it is a pin an earlier run left: a regular file
    with one link, owned by this process's user, starting with ``text``; read without
    following a link. True when one was removed."""
    try:
        directory = _open_folder(folder)
    except OSError:
        return False
    try:
        flags = (os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
                 | getattr(os, "O_CLOEXEC", 0))
        try:
            handle = os.open(UPLOADING_MARKER, flags, dir_fd=directory)
        except OSError as exc:
            if exc.errno not in (errno.ENOENT, errno.ELOOP, errno.ENXIO):
                raise
            return False  # none, a link, a socket: not ours
        try:
            found = os.fstat(handle)
            if (not stat.S_ISREG(found.st_mode) or found.st_nlink != 1
                    or found.st_uid != os.geteuid()):
                return False
            head = os.read(handle, _MARKER_MOST)
        finally:
            os.close(handle)
        if not head.startswith(text.encode("utf-8")):
            return False
        now = os.lstat(UPLOADING_MARKER, dir_fd=directory)
        if (now.st_dev, now.st_ino) != (found.st_dev, found.st_ino):
            return False  # replaced since it was read
        os.unlink(UPLOADING_MARKER, dir_fd=directory)
        return True
    except OSError:
        return False
    finally:
        os.close(directory)


def open_job_file(folder: Path, relative: str) -> int:
    """Open ``folder/relative`` (``folder`` directly under the upload-from root) for
    reading under the rules above. Returns a file descriptor; raises :class:`Refused`,
    :class:`Invalid` (missing, not a regular file) or ``OSError``."""
    folder = Path(folder)
    root = os.open(folder.parent, _DIRECTORY)
    try:
        owner = os.fstat(root).st_uid
        try:
            checkpoint = os.open(folder.name, _NO_FOLLOW_DIRECTORY, dir_fd=root)
        except OSError:
            if os.path.islink(folder):
                raise Refused(f"{printable(folder.name)} is a symbolic link, not a folder "
                              "of the job's") from None
            raise
    finally:
        os.close(root)
    try:
        handle = open_under(checkpoint, relative)
    except Invalid as exc:
        raise Invalid(printable(str(exc))) from None
    finally:
        os.close(checkpoint)
    try:
        _check(os.fstat(handle), owner, f"{folder.name}/{relative}")
    except BaseException:
        os.close(handle)
        raise
    return handle


def read_job_file(folder: Path, relative: str, most: int = MAX_MANIFEST_BYTES) -> bytes:
    """The bytes of a job's file read through :func:`open_job_file` (a manifest): one of
    more than ``most`` bytes is refused unread."""
    handle = open_job_file(folder, relative)
    try:
        return read_at_most(handle, most, printable(f"{Path(folder).name}/{relative}"))
    except Invalid as exc:
        raise Refused(str(exc)) from None


def _check(found: os.stat_result, owner: int, shown: str) -> None:
    name = printable(shown)
    if not stat.S_ISREG(found.st_mode):
        raise Refused(f"{name} is not a regular file")
    if found.st_nlink != 1:
        raise Refused(f"{name} has {found.st_nlink} hard links: a file linked from "
                      "elsewhere is not read")
    if found.st_uid != owner and not found.st_mode & stat.S_IROTH:
        raise Refused(f"{name} belongs to uid {found.st_uid}, not to uid {owner} who owns "
                      "the upload-from folder, and only its owner may read it")
