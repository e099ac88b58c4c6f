"""A checkpoint's files copied into a folder and verified in the same pass: every byte is
read once, written, and hashed on its way; nothing is read back (issue 40, item 1).

Files are copied in parallel by a bounded pool of threads (reads, writes and sha256 all
release the GIL, so the threads use every core); a file larger than ``RANGE_SIZE`` is cut
into ranges fetched in parallel. sha256 is sequential, so each file has one
:class:`InOrderHash` that takes its bytes in file order: the range holding the next
unhashed byte hashes as it goes, and pieces of later ranges wait in a reorder buffer
bounded by ``REORDER_LIMIT`` until their turn (a range ahead of it blocks at the bound).
One file is therefore hashed at most at one core's sha256 speed; several files use
several cores. A file is finished by the worker that delivered its last byte: the size
and the sha256 against the manifest, then ``fdatasync`` (in parallel with the other
files, so the commit's fsync finds little left to write).

Where the bytes come from is a :class:`Source`: :class:`FolderSource` reads a checkpoint
folder (a volume; each file opened without following a link, its size checked), the S3
one does ranged GETs (``sidecar.host.upload.restore``). Every target file is created
``O_CREAT|O_EXCL|O_NOFOLLOW`` relative to the open target folder, each folder on the way
opened with ``O_NOFOLLOW``: no link under the target is followed.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Protocol, Union

from sidecar.checkpoint.manifest import FileEntry, Invalid, open_listed

__all__ = [
    "CHUNK_SIZE",
    "RANGE_SIZE",
    "REORDER_LIMIT",
    "FolderSource",
    "InOrderHash",
    "Sink",
    "Source",
    "copy_verified",
    "default_workers",
    "size_mismatch",
]

MIB = 1 << 20
CHUNK_SIZE = 4 * MIB  # one read, write and hash update
RANGE_SIZE = 8 * MIB  # a larger file is cut into ranges of this size (s3transfer's chunk)
REORDER_LIMIT = 64 * MIB  # bytes of a file's later ranges held while an earlier one is behind
MIN_WORKERS = 4  # even on a small machine: one thread waits on I/O while another hashes

Piece = Union[bytes, memoryview]
Sink = Callable[[int, Piece], None]  # (offset in the file, the bytes there)
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_FOLDER = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | getattr(os, "O_DIRECTORY", 0)


class Source(Protocol):
    def read(self, entry: FileEntry, offset: int, length: int, sink: Sink) -> None:
        """Hand the bytes ``[offset, offset + length)`` of ``entry`` to ``sink``, in order,
        in pieces of at most ``CHUNK_SIZE``. Raises :class:`Invalid` when the file is not
        the size the manifest says (:func:`size_mismatch`), or the source's own error."""


class Stopped(Exception):
    """Another file failed: the rest of the copy stops."""


def size_mismatch(entry: FileEntry, size: int) -> Invalid:
    return Invalid(f"file {entry.path} is {size} bytes, the manifest says {entry.size}")


def default_workers() -> int:
    """Threads for a copy from a folder: every usable core, at least ``MIN_WORKERS``."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    return max(MIN_WORKERS, cores)


class InOrderHash:
    """sha256 of a file whose pieces arrive out of order from parallel ranges.

    The piece at the next unhashed offset is hashed by the thread that brings it (and
    then every held piece that follows); any other piece is held, at most ``limit`` bytes
    of them (one piece always fits): a thread with a later piece waits there until the
    earlier ranges catch up. The range holding the next offset never waits, so this ends
    as long as each range's pieces come in order and a file's ranges start in order."""

    def __init__(self, limit: int) -> None:
        self._hasher = hashlib.sha256()
        self._limit = limit
        self._next = 0  # the first byte not hashed yet
        self._held: dict[int, bytes] = {}
        self._held_bytes = 0
        self._busy = False  # a thread is hashing; it takes every held piece in turn
        self._failed = False
        self._changed = threading.Condition()

    def feed(self, offset: int, data: Piece) -> None:
        with self._changed:
            while (offset != self._next and self._held_bytes
                   and self._held_bytes + len(data) > self._limit and not self._failed):
                self._changed.wait()
            if self._failed:
                raise Stopped()
            if self._busy or offset != self._next:
                self._held[offset] = bytes(data)  # a copy: the caller reuses its buffer
                self._held_bytes += len(data)
                return
            self._busy = True
            self._next += len(data)
        piece: Optional[Piece] = data
        while piece is not None:
            self._hasher.update(piece)  # outside the lock: other ranges go on meanwhile
            with self._changed:
                piece = self._held.pop(self._next, None)
                if piece is None:
                    self._busy = False
                else:
                    self._held_bytes -= len(piece)
                    self._next += len(piece)
                self._changed.notify_all()

    def fail(self) -> None:
        """Wake every waiting thread: the copy stops."""
        with self._changed:
            self._failed = True
            self._changed.notify_all()

    def hexdigest(self, size: int) -> Optional[str]:
        """The sha256 once all ``size`` bytes were fed and hashed; None when they were not
        (a piece missing: the copy failed)."""
        with self._changed:
            while self._busy and not self._failed:
                self._changed.wait()
            if self._next != size or self._held:
                return None
        return self._hasher.hexdigest()


@dataclass(frozen=True)
class FolderSource:
    """A checkpoint folder on a volume: each range opens its file without following a
    link (``open_listed``), checks its size and reads it with ``pread``."""

    folder: Path

    def read(self, entry: FileEntry, offset: int, length: int, sink: Sink) -> None:
        handle = open_listed(self.folder, entry.path)
        try:
            size = os.fstat(handle).st_size
            if size != entry.size:
                raise size_mismatch(entry, size)
            if hasattr(os, "posix_fadvise"):  # a larger read-ahead, from cold caches too
                os.posix_fadvise(handle, offset, length, os.POSIX_FADV_SEQUENTIAL)
            buffer = bytearray(min(CHUNK_SIZE, length))
            view = memoryview(buffer)
            done = 0
            while done < length:
                count = os.preadv(handle, [view[:min(len(buffer), length - done)]],
                                  offset + done)
                if count == 0:  # shorter than it said a moment ago
                    raise size_mismatch(entry, offset + done)
                sink(offset + done, view[:count])
                done += count
        finally:
            os.close(handle)


@dataclass
class _File:
    """One file being copied: its target, its hash and how many ranges are still out."""

    entry: FileEntry
    hash: Optional[InOrderHash]
    ranges_left: int
    handle: int = -1
    lock: threading.Lock = field(default_factory=threading.Lock)


def _create_under(folder: int, relative: str) -> int:
    """Create the new file ``relative`` under the open ``folder`` (its sub-folders made
    as needed), following no link on the way. Returns the file's descriptor."""
    parts = relative.split("/")
    if any(part in ("", ".", "..") for part in parts):  # read_manifest refuses them too
        raise Invalid(f"manifest lists an unsafe path: {relative!r}")
    current = os.dup(folder)
    try:
        for part in parts[:-1]:
            with contextlib.suppress(FileExistsError):
                os.mkdir(part, 0o777, dir_fd=current)
            below = os.open(part, _FOLDER, dir_fd=current)
            os.close(current)
            current = below
        return os.open(parts[-1], _NEW_FILE, 0o666, dir_fd=current)
    finally:
        os.close(current)


def _ranges(files: Sequence[_File], range_size: int) -> list[tuple[_File, int, int]]:
    """Every file's first range, then every second one, ...: the threads start on
    different files (no reordering) before they share one."""
    plans = []
    for item in files:
        size = item.entry.size
        plans.append([(item, start, min(range_size, size - start))
                      for start in range(0, size, range_size)] or [(item, 0, 0)])
        item.ranges_left = len(plans[-1])
    ordered = []
    for index in range(max((len(plan) for plan in plans), default=0)):
        ordered += [plan[index] for plan in plans if index < len(plan)]
    return ordered


def copy_verified(
    source: Source,
    entries: Sequence[FileEntry],
    into: Path,
    *,
    verify_checksums: bool = True,
    workers: Optional[int] = None,
    on_progress: Callable[[int], None] = lambda count: None,
) -> None:
    """Copy ``entries`` from ``source`` into the folder ``into`` (ours, existing), each
    file checked in the same pass: its size, and its sha256 when the manifest has one and
    ``verify_checksums``. ``on_progress(count)`` is called from the worker threads. The
    first failure stops the rest and is raised: :class:`Invalid` for a file that does not
    match its manifest, else the source's error. Files written so far stay in ``into``
    for the caller to remove."""
    files = [_File(entry, InOrderHash(REORDER_LIMIT)
                   if verify_checksums and entry.sha256 else None, 0) for entry in entries]
    plan = _ranges(files, max(1, RANGE_SIZE))
    failed = threading.Event()
    errors: list[BaseException] = []
    folder = os.open(into, _FOLDER)

    def target(item: _File) -> int:
        with item.lock:
            if item.handle < 0:
                item.handle = _create_under(folder, item.entry.path)
            return item.handle

    def finish(item: _File) -> None:
        entry = item.entry
        if item.hash is not None and item.hash.hexdigest(entry.size) != entry.sha256:
            raise Invalid(f"file {entry.path} does not match its sha256 in the manifest")
        os.fdatasync(target(item))

    def copy_range(item: _File, offset: int, length: int) -> None:
        if failed.is_set():
            return

        def sink(at: int, piece: Piece) -> None:
            if failed.is_set():
                raise Stopped()
            written = 0
            while written < len(piece):
                written += os.pwrite(handle, piece[written:], at + written)
            if item.hash is not None:
                item.hash.feed(at, piece)
            on_progress(len(piece))

        try:
            handle = target(item)
            source.read(item.entry, offset, length, sink)
            with item.lock:
                item.ranges_left -= 1
                last = item.ranges_left == 0
            if last:
                finish(item)
        except BaseException as exc:
            if not isinstance(exc, Stopped):
                errors.append(exc)
            failed.set()
            for each in files:
                if each.hash is not None:
                    each.hash.fail()

    try:
        count = max(1, min(workers or default_workers(), len(plan)))
        with ThreadPoolExecutor(max_workers=count, thread_name_prefix="restore") as pool:
            for item, offset, length in plan:
                pool.submit(copy_range, item, offset, length)
    finally:
        os.close(folder)
        for item in files:
            if item.handle >= 0:
                os.close(item.handle)
    if errors:
        raise errors[0]
