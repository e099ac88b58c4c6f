"""The checkpoint waits for the job (issue 40, item 2): the daemon of a fresh machine brings
the newest durable checkpoint into the local checkpoint folder before any job starts, and
follows newer ones until a job writes there.

On a machine whose settings name ``--upload-from DIR`` and ``--upload-to URL`` (and
``--upload-prefetch`` not false), the daemon starts a :class:`Follower`. Every
``interval_seconds`` it asks the destination for its newest durable checkpoint; when that
is newer than every valid checkpoint in the folder, it copies it in: only the files that
changed since its previous copy are fetched, the unchanged ones hard-linked from it. A
copy is built out of sight and appears complete, by one rename (``follow_place``: the
folder is the job's and hostile). Its previous copy is then removed: the folder holds one
checkpoint's bytes plus, while a newer one comes, the changed files.

It stops for good, and discards a copy in progress, as soon as a job writes there: an
entry named like a save in progress or its leftovers (``.tmp-``, ``.old-``, ``.del-``, not
the follower's own), or any entry that was not there at its start and that it did not
make. ``esi-sidecar run`` and ``restore`` then find the checkpoint in place (the same
manifest) and return at once. The uploader, seeing the copy, finds the same manifest at
the destination and marks it durable without sending a byte.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from sidecar.checkpoint.durable import rename_durably
from sidecar.checkpoint.folders import list_checkpoints
from sidecar.checkpoint.manifest import FileEntry, Invalid, read_manifest
from sidecar.host.logs import printable
from sidecar.host.upload.follow_place import (
    Private,
    clean_own,
    hand_over,
    is_own_name,
    link_unchanged,
    no_replace,
    open_folder,
    place_latest,
    retire,
)
from sidecar.host.upload.follow_sources import Durable, FollowSource
from sidecar.host.upload.volume import Cancelled

__all__ = ["DEFAULT_INTERVAL_SECONDS", "Brought", "Follower"]

log = logging.getLogger("sidecar.host.upload.follower")

# How often the destination is asked for a newer checkpoint: a listing (S3: one LIST and
# a manifest GET; a volume: a folder scan) every few seconds, while no job runs.
DEFAULT_INTERVAL_SECONDS = 5.0
_CHECK_EVERY_SECONDS = 0.05  # during a copy: how often the folder is looked at for a job
_JOB_PREFIXES = (".tmp-", ".old-", ".del-")


@dataclass(frozen=True)
class Brought:
    """One checkpoint the follower put in place."""

    name: str
    step: int
    started_unix: float
    finished_unix: float
    fetched_bytes: int
    linked_bytes: int

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class _Copy:
    name: str
    inode: int
    files: dict[str, FileEntry] = field(default_factory=dict)


class Follower:
    """Start with :meth:`start`, stop with :meth:`stop`; :meth:`status` says what it did."""

    def __init__(self, root: Path, source: FollowSource, *,
                 interval_seconds: float = DEFAULT_INTERVAL_SECONDS,
                 clock: Callable[[], float] = time.time,
                 on_brought: Callable[[Brought], None] = lambda brought: None) -> None:
        self.root = root
        self.source = source
        self.interval_seconds = interval_seconds
        self._clock = clock
        self._on_brought = on_brought
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._root_fd: Optional[int] = None
        self._baseline: dict[str, int] = {}  # entries at the start: name -> inode
        self._watching = False  # the folder is open and its entries at the start noted
        self._made: dict[str, int] = {}  # entries the follower made: name -> inode
        self._copy: Optional[_Copy] = None
        self._latest: Optional[int] = None  # inode of the latest pointer it made
        self._refused: set[str] = set()  # names it could not place (one line each)
        self._last_error: Optional[str] = None
        self._checked_at = 0.0
        self.brought: list[Brought] = []
        self.stopped_because: Optional[str] = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="esi-sidecar-follow",
                                        daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def status(self) -> dict[str, Any]:
        """A query: what was brought, and why it stopped (None while following)."""
        return {"following": self.alive() and self._watching and self.stopped_because is None,
                "stopped_because": self.stopped_because,
                "brought": [b.to_json() for b in self.brought]}

    # ------------------------------------------------------------------ the loop

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if self._root_fd is None and not self._open():
                    self._stop.wait(self.interval_seconds)  # the folder is not there yet
                    continue
                why = self._job_writes()
                if why is not None:
                    self._stopped(why)
                    return
                self._once()
                self._stop.wait(self.interval_seconds)
        finally:
            if self._root_fd is not None:
                os.close(self._root_fd)

    def _open(self) -> bool:
        try:
            handle = open_folder(self.root)
        except OSError:
            return False
        self._root_fd = handle
        if clean_own(handle):
            log.info("removed what a killed follower left in %s", self.root)
        self._baseline = {entry.name: entry.inode() for entry in os.scandir(handle)}
        self._watching = True
        log.info("bringing the newest durable checkpoint from %s into %s before the job "
                 "starts (off: --upload-prefetch false)", self.source.url, self.root)
        return True

    def _stopped(self, why: str) -> None:
        self.stopped_because = why
        log.info("no longer following %s: %s", self.source.url, printable(why))

    def _job_writes(self) -> Optional[str]:
        """Why a job is taken to write in the folder now, or None."""
        assert self._root_fd is not None
        for entry in os.scandir(self._root_fd):
            name = entry.name
            if is_own_name(name):
                continue
            if name.startswith(_JOB_PREFIXES):
                return f"a job writes in {self.root} ({printable(name)})"
            try:
                inode = entry.inode()
            except OSError:
                continue
            if self._baseline.get(name) != inode and self._made.get(name) != inode:
                return f"a job made {printable(name)} in {self.root}"
        return None

    def _should_stop(self) -> Optional[str]:
        if self._stop.is_set():
            return "the daemon is stopping"
        now = time.monotonic()
        if now - self._checked_at < _CHECK_EVERY_SECONDS:
            return None
        self._checked_at = now
        return self._job_writes()

    def _once(self) -> None:
        try:
            found = self.source.newest()
        except Exception as exc:
            self._error(f"reading {self.source.url}: {type(exc).__name__}: {exc}")
            return
        if found is None or found.name in self._refused or not self._newer(found):
            return
        try:
            self._bring(found)
        except Cancelled as exc:
            reason = str(exc)
            if reason != "the daemon is stopping":
                self._stopped(reason)
                self._stop.set()
        except FileExistsError:
            self._refused.add(found.name)
            log.info("not placing %s: an entry of that name is in %s", found.name, self.root)
        except Exception as exc:
            self._error(f"bringing {found.name} from {self.source.url}: "
                        f"{type(exc).__name__}: {exc}")
        else:
            self._last_error = None

    def _error(self, message: str) -> None:
        if message != self._last_error:
            log.warning("%s; trying again in %.0f s", printable(message), self.interval_seconds)
        self._last_error = message

    def _newer(self, found: Durable) -> bool:
        for listing in list_checkpoints(self.root):
            if listing.info is not None:  # newest first
                return (found.info.step, found.info.created_at) > (
                    listing.info.step, listing.info.created_at)
        return True

    # ------------------------------------------------------------------ one copy

    def _bring(self, found: Durable) -> None:
        root_fd = self._root_fd
        assert root_fd is not None
        started = self._clock()
        owner = os.fstat(root_fd)
        previous, previous_fd = self._copy, None
        same: tuple[FileEntry, ...] = ()
        if previous is not None:
            try:
                previous_fd = os.open(previous.name, os.O_RDONLY | os.O_DIRECTORY
                                      | os.O_NOFOLLOW, dir_fd=root_fd)
                if os.fstat(previous_fd).st_ino != previous.inode:
                    os.close(previous_fd)
                    previous_fd = None
            except OSError:
                previous_fd = None
        if previous is not None and previous_fd is not None:
            same = tuple(entry for entry in found.info.files if entry.sha256 and
                         previous.files.get(entry.path) == entry)
        private = Private(root_fd)
        try:
            linked = 0
            try:
                changed = tuple(e for e in found.info.files if e not in same)
                folder = self.source.fetch(found, changed, private.path, self._should_stop)
                if previous_fd is not None and same:
                    try:
                        linked = link_unchanged(previous_fd, folder, same)
                    except Invalid:  # the previous copy changed: fetch it whole
                        folder = self._refetch(found, private, folder)
                        linked = 0
            finally:
                if previous_fd is not None:
                    os.close(previous_fd)
            read_manifest(folder)  # complete (the manifest parses) before it is handed over
            hand_over(folder, owner.st_uid, owner.st_gid)
            why = "the daemon is stopping" if self._stop.is_set() else self._job_writes()
            if why is not None:
                raise Cancelled(why)
            rename_durably(found.name, found.name, src_dir_fd=private.fd, dst_dir_fd=root_fd,
                           rename=no_replace)
            inode = os.lstat(found.name, dir_fd=root_fd).st_ino
            self._made[found.name] = inode
            try:
                made = place_latest(private, root_fd, found.name, owner.st_uid,
                                    owner.st_gid, self._latest)
            except OSError as exc:
                log.warning("%s placed; the latest pointer not: %s", found.name, exc)
            else:
                if made is not None:
                    self._latest = made
                    self._made["latest"] = made
        finally:
            private.discard()
        self._copy = _Copy(found.name, inode, {e.path: e for e in found.info.files})
        if previous is not None and previous.name != found.name:
            try:
                retire(root_fd, previous.name, previous.inode)
            except OSError as exc:
                log.warning("could not remove the previous copy %s: %s", previous.name, exc)
            self._made.pop(previous.name, None)
        fetched = found.info.total_bytes - linked
        brought = Brought(found.name, found.info.step, started, self._clock(), fetched, linked)
        self.brought.append(brought)
        log.info("%s (step %d) is in place in %s: %d bytes fetched, %d linked from the "
                 "previous copy, in %.1f s", found.name, found.info.step, self.root, fetched,
                 linked, brought.finished_unix - started)
        self._on_brought(brought)

    def _refetch(self, found: Durable, private: Private, folder: Path) -> Path:
        """The whole checkpoint fetched again, in place of a partial private copy."""
        shutil.rmtree(folder)
        return self.source.fetch(found, found.info.files, private.path, self._should_stop)
