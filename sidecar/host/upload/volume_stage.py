"""A checkpoint's files on the volume before it is visible: a hidden folder filled file by
file while the save still writes, committed by the manifest (issue 23, items 1 and 2).

The folder is named like a save's temporary folder (``.tmp-<name>.<writer>.<token>``), so
a killed daemon's is removed by ``clean_leftovers`` at the next start, and
:func:`~sidecar.host.upload.volume.seal_folder` commits it as every volume copy is
committed: files fsynced, manifest last, rename, root fsynced. A file equal to one of a
durable checkpoint on the volume is a hard link to it (``copy_file_range`` where a link
is refused), so each checkpoint folder owns all its files and deleting one never takes a
file from another.

A committed file is never written again (issue 35, item 2): a file shared by two durable
checkpoints is one inode, and a write in place would change both. So nothing here opens
an existing name for writing: new content is written to a new, exclusively created
temporary file (``O_CREAT|O_EXCL|O_NOFOLLOW``) and renamed onto its name, which replaces
the name and leaves the old inode as it was; at the commit every file is made read-only
(0444). Root ignores modes: the modes are a second line, the first is that no code path
writes in place.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import stat
import time
from pathlib import Path
from typing import Callable, Optional

from sidecar.checkpoint.durable import (
    fsync_fd,
    fsync_path,
    rename_durably,
    sync_tree,
    write_durably,
)
from sidecar.checkpoint.leftovers import writer_tag
from sidecar.checkpoint.manifest import MANIFEST_NAME, CheckpointInfo
from sidecar.host.upload.commit_check import DurableFile, StagedFile, StatKey, stat_key
from sidecar.host.upload.jobfiles import open_job_file

__all__ = [
    "READ_ONLY",
    "Cancelled",
    "Throttle",
    "VolumeStaging",
    "make_read_only",
    "seal_folder",
    "staging_folder",
    "token",
]

_CHUNK = 4 << 20
READ_ONLY = 0o444  # a committed file's mode
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class Cancelled(Exception):
    """The copy stopped on request (``should_stop`` gave this reason)."""


class Throttle:
    """Keeps a transfer at or under ``bytes_per_second`` (None: no limit)."""

    def __init__(self, bytes_per_second: Optional[int],
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.rate = bytes_per_second
        self._sleep = sleep
        self._started = time.monotonic()
        self._sent = 0

    def __call__(self, count: int) -> None:
        if not self.rate:
            return
        self._sent += count
        ahead = self._sent / self.rate - (time.monotonic() - self._started)
        if ahead > 0:
            self._sleep(ahead)


def token() -> str:
    return os.urandom(4).hex()


def staging_folder(root: Path, name: str) -> Path:
    """A hidden folder for ``name``'s files before the commit, named like a save's, so
    ``clean_leftovers`` removes it once its writer is gone."""
    return root / f".tmp-{name}.{writer_tag()}.{token()}"


def make_read_only(folder: Path) -> None:
    """Every regular file under ``folder`` (ours: a staging folder) set to 0444, opened
    without following a link."""
    for current, _, filenames in os.walk(folder):
        for filename in filenames:
            try:
                handle = os.open(Path(current, filename), os.O_RDONLY | os.O_NOFOLLOW)
            except OSError:  # a link: not ours to change (sync_tree skips it as well)
                continue
            try:
                if stat.S_ISREG(os.fstat(handle).st_mode):
                    os.fchmod(handle, READ_ONLY)
            finally:
                os.close(handle)


def seal_folder(root: Path, name: str, temp: Path, manifest: bytes,
                before_rename: Callable[[], None] = lambda: None, *,
                read_only: bool = False) -> Path:
    """Every file and folder of ``temp`` fsynced, ``manifest`` written last, the folder
    renamed to ``root/<name>`` (an existing one moved aside first, and back if the rename
    fails) and ``root`` fsynced. ``read_only``: every file made 0444 before the rename (a
    volume's checkpoints: their files may be shared with other checkpoints). On an
    error ``temp`` is left for the caller to remove."""
    final = root / name
    aside: Optional[Path] = None
    sync_tree(temp)  # every file and folder, deepest first
    write_durably(temp / MANIFEST_NAME, manifest)  # last: complete from here on
    if read_only:
        make_read_only(temp)  # the mode is metadata: the fsync of the folder below keeps it
    fsync_path(temp)
    before_rename()
    if os.path.lexists(final):  # the same name saved again: the new one replaces it
        aside = root / f".old-{name}.{writer_tag()}.{token()}"
        os.rename(final, aside)

    def put_back() -> None:
        if aside is not None:
            os.rename(aside, final)

    rename_durably(temp, final, undo=put_back)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)  # after the fsync: the new one is durable
    return final


class VolumeStaging:
    """One checkpoint's hidden folder on the volume (the ``commit_check.Staging`` protocol)."""

    def __init__(self, root: Path, name: str, *, max_bandwidth: Optional[int] = None,
                 before_rename: Callable[[], None] = lambda: None) -> None:
        self.root = root
        self.name = name
        self.max_bandwidth = max_bandwidth
        self._before_rename = before_rename
        self.temp = staging_folder(root, name)
        self.temp.mkdir()
        self.files: dict[str, StagedFile] = {}

    def _target(self, relative: str) -> Path:
        target = self.temp / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        return target

    def send(self, folder: Path, relative: str, *, on_progress: Callable[[int], None],
             should_stop: Callable[[], Optional[str]]) -> Optional[StagedFile]:
        target = self._target(relative)
        throttle = Throttle(self.max_bandwidth)  # per file: no credit from idle time
        hasher = hashlib.sha256()
        count = 0
        with open(open_job_file(folder, relative), "rb", buffering=0) as reader, \
                _NewFile(target) as writer:
            before = stat_key(os.fstat(reader.fileno()))
            try:
                while True:
                    reason = should_stop()
                    if reason:
                        raise Cancelled(reason)
                    chunk = reader.read(_CHUNK)
                    if not chunk:
                        break
                    writer.write(chunk)
                    hasher.update(chunk)
                    count += len(chunk)
                    on_progress(len(chunk))
                    throttle(len(chunk))
            except BaseException:
                on_progress(-count)
                raise
            after = stat_key(os.fstat(reader.fileno()))
            if before != after or count != after[1]:  # written to while it was read
                on_progress(-count)
                self.drop(relative)  # what was staged before is not that file either
                return None
            writer.place()  # fsynced now, not at the commit: the commit stays short
        staged = StagedFile(relative, count, hasher.hexdigest(), after)
        self.files[relative] = staged
        return staged

    def copy(self, relative: str, durable: DurableFile, key: StatKey) -> Optional[StagedFile]:
        source = self.root / durable.checkpoint / relative
        try:
            found = os.lstat(source)
        except OSError:
            return None
        if not stat.S_ISREG(found.st_mode) or found.st_size != durable.size:
            return None
        target = self._target(relative)
        if not (_link(source, target) or _copy_in_kernel(source, target, durable.size)):
            return None
        staged = StagedFile(relative, durable.size, durable.sha256, key)  # in its own folder
        self.files[relative] = staged
        return staged

    def drop(self, relative: str) -> None:
        self.files.pop(relative, None)
        with contextlib.suppress(FileNotFoundError):
            (self.temp / relative).unlink()

    def finish(self, info: CheckpointInfo, manifest: bytes) -> None:
        try:
            seal_folder(self.root, self.name, self.temp, manifest, self._before_rename,
                        read_only=True)
        except BaseException:
            self.discard()
            raise

    def discard(self) -> None:
        shutil.rmtree(self.temp, ignore_errors=True)
        self.files.clear()


class _NewFile:
    """A new file for ``target``: written to an exclusively created temporary file beside
    it and renamed onto ``target`` by :meth:`place` (after an fsync); removed when not
    placed. An existing ``target`` (a link to a committed file) is never opened."""

    def __init__(self, target: Path) -> None:
        self.target = target
        self.temp = target.with_name(f".part-{target.name}.{token()}")
        self._fd = os.open(self.temp, _NEW_FILE, 0o600)
        self._placed = False

    def write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view):]

    def fileno(self) -> int:
        return self._fd

    def place(self) -> None:
        fsync_fd(self._fd)
        _rename_onto(self.temp, self.target)
        self._placed = True

    def __enter__(self) -> _NewFile:
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self._fd)
        if not self._placed:
            with contextlib.suppress(FileNotFoundError):
                self.temp.unlink()


def _rename_onto(temp: Path, target: Path) -> None:
    """``temp`` takes ``target``'s name. rename(2) does nothing when both are links to one
    inode; the temporary name is removed then."""
    os.replace(temp, target)
    with contextlib.suppress(FileNotFoundError):
        temp.unlink()


def _link(source: Path, target: Path) -> bool:
    """``target`` made a hard link to ``source`` (a committed file); False when the file
    system refuses links here (EXDEV, EPERM, EMLINK)."""
    temp = target.with_name(f".part-{target.name}.{token()}")
    try:
        os.link(source, temp, follow_symlinks=False)
    except OSError:
        return False
    try:
        _rename_onto(temp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            temp.unlink()
        raise
    return True


def _copy_in_kernel(source: Path, target: Path, size: int) -> bool:
    """``copy_file_range`` (reflinks or server-side copies on file systems that have them);
    False when it is not possible, then the caller sends the bytes."""
    copy_range = getattr(os, "copy_file_range", None)
    if copy_range is None:
        return False
    done = 0
    try:
        reader = os.open(source, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            with _NewFile(target) as writer:
                while done < size:
                    moved = copy_range(reader, writer.fileno(), size - done)
                    if moved <= 0:
                        break
                    done += moved
                if done == size:
                    writer.place()
        finally:
            os.close(reader)
    except OSError:
        return False
    return done == size
