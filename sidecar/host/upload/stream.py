"""Saves in progress, watched: the temporary folders of ``atomic_checkpoint`` (and so of the
DCP integration, which commits through it) and which of their files are finished, so the
uploader sends each one while the save still writes the others (issue 23, item 1).

Finished, without touching the user's save code: a file is finished when its writer
closed it (inotify's IN_CLOSE_WRITE, through watchdog, on Linux) and it has not changed
since, or, where no such event comes (another OS, a network file system, watchdog
missing), when its inode, size, mtime and ctime have stayed the same for
``settle_seconds``. Either way it is only a hint for when to start: the commit check
(:mod:`~sidecar.host.upload.commit_check`) compares every file sent early with the
manifest that lands, and a file written to after it was sent is sent again. So a writer
that pauses longer than ``settle_seconds``, or reopens a file, costs bytes, never
correctness.

A folder keeps its inode through the commit's rename, so the committed checkpoint finds
the files sent for it (:meth:`StreamWatcher.take`). A temporary folder that vanishes any
other way (the save raised, the trainer cleaned a killed save's leftover) is abandoned:
its staged files are discarded and nothing of it ever becomes visible.
"""

from __future__ import annotations

import logging
import os
import re
import stat
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from sidecar.checkpoint.manifest import MANIFEST_NAME, PIN_MARKERS
from sidecar.host.upload.commit_check import Staging, StatKey, stat_key

__all__ = ["DEFAULT_SETTLE_SECONDS", "FolderId", "SaveInProgress", "StreamWatcher"]

log = logging.getLogger("sidecar.host.upload.stream")

DEFAULT_SETTLE_SECONDS = 1.0
# atomic_checkpoint's temporary folder: .tmp-<name>.<host>-<pid>-<start>.<token>
_TEMP = re.compile(r"^\.tmp-(?P<name>.+)\.[0-9a-f]{8}-\d{1,10}-\d{1,20}\.[0-9a-f]{8}$")
_NOT_SENT = frozenset((MANIFEST_NAME, *PIN_MARKERS))

FolderId = tuple[int, int]  # st_dev, st_ino: the same folder before and after the rename


def folder_id(path: Path) -> Optional[FolderId]:
    try:
        found = os.stat(path, follow_symlinks=False)
    except OSError:
        return None
    return (found.st_dev, found.st_ino) if stat.S_ISDIR(found.st_mode) else None


@dataclass
class SaveInProgress:
    """One save being written, and what of it is at the destination already."""

    path: Path  # its temporary folder
    name: str  # the checkpoint it becomes
    folder: FolderId
    created: float  # time.monotonic() when first seen: newest saves stream first
    keys: dict[str, tuple[StatKey, float]] = field(default_factory=dict)  # key, since
    closed: dict[str, StatKey] = field(default_factory=dict)  # key when its writer closed it
    tried: dict[str, StatKey] = field(default_factory=dict)  # sent (or refused) at this key
    staging: Optional[Staging] = None
    committed: bool = False  # renamed into place: waiting for the uploader to take it
    sent_bytes: int = 0
    send_seconds: float = 0.0

    def unsent(self) -> int:
        """Bytes of files not yet at the destination as they are now."""
        return sum(key[1] for relative, (key, _) in self.keys.items()
                   if self.tried.get(relative) != key)


class StreamWatcher:
    """Finds saves in progress under ``root`` and says which file to send next."""

    def __init__(self, root: Path, *, settle_seconds: float = DEFAULT_SETTLE_SECONDS,
                 on_change: Callable[[], None] = lambda: None,
                 monotonic: Callable[[], float] = time.monotonic) -> None:
        self.root = root
        self.settle_seconds = settle_seconds
        self._on_change = on_change
        self._monotonic = monotonic
        self._lock = threading.Lock()  # guards ``closed`` (written by watchdog's thread)
        self.saves: dict[FolderId, SaveInProgress] = {}
        self._observers: dict[FolderId, Any] = {}

    # ------------------------------------------------------------------ scanning

    def scan(self) -> list[SaveInProgress]:
        """Look again; returns the saves abandoned since the last scan (their staging is
        the caller's to discard)."""
        now = self._monotonic()
        present: set[FolderId] = set()
        try:
            entries = list(os.scandir(self.root))
        except OSError:
            entries = []
        for entry in entries:
            match = _TEMP.match(entry.name)
            if match is None:
                continue
            path = Path(entry.path)
            ident = folder_id(path)
            if ident is None:
                continue
            present.add(ident)
            save = self.saves.get(ident)
            if save is None:
                save = SaveInProgress(path, match["name"], ident, now)
                self.saves[ident] = save
                self._watch(save)
            self._look(save, now)
        abandoned = []
        for ident, save in list(self.saves.items()):
            if ident in present or save.committed:
                continue
            if folder_id(self.root / save.name) == ident:
                save.committed = True  # renamed into place; the uploader takes it next
                self._unwatch(ident)
                continue
            del self.saves[ident]
            self._unwatch(ident)
            abandoned.append(save)
        return abandoned

    def _look(self, save: SaveInProgress, now: float) -> None:
        seen: dict[str, tuple[StatKey, float]] = {}
        for current, dirnames, filenames in os.walk(save.path):
            dirnames.sort()
            for filename in filenames:
                full = os.path.join(current, filename)
                relative = os.path.relpath(full, save.path).replace(os.sep, "/")
                if relative in _NOT_SENT:
                    continue
                try:
                    found = os.lstat(full)
                except OSError:
                    continue
                if not stat.S_ISREG(found.st_mode):
                    continue  # links and special files are never part of a checkpoint
                key = stat_key(found)
                old = save.keys.get(relative)
                seen[relative] = old if old is not None and old[0] == key else (key, now)
        save.keys = seen

    def ready(self) -> Optional[tuple[SaveInProgress, str, StatKey]]:
        """The next finished file to send: newest save first, then by path."""
        now = self._monotonic()
        for save in sorted(self.saves.values(), key=lambda s: s.created, reverse=True):
            if save.committed:
                continue
            with self._lock:
                closed = dict(save.closed)
            for relative in sorted(save.keys):
                key, since = save.keys[relative]
                if save.tried.get(relative) == key:
                    continue
                if closed.get(relative) == key or now - since >= self.settle_seconds:
                    return save, relative, key
        return None

    def waiting(self) -> bool:
        """Whether some save in progress has files not sent yet (poll sooner)."""
        return any(not save.committed and save.unsent() for save in self.saves.values())

    def take(self, ident: FolderId, name: str) -> Optional[SaveInProgress]:
        """The save that became the committed folder ``ident`` (named ``name``), if any
        of it was sent; it is no longer watched."""
        save = self.saves.get(ident)
        if save is None or save.name != name:
            return None
        del self.saves[ident]
        self._unwatch(ident)
        return save

    def stop(self) -> list[SaveInProgress]:
        """Stop watching; returns every save still held (to discard)."""
        for ident in list(self._observers):
            self._unwatch(ident)
        saves, self.saves = list(self.saves.values()), {}
        return saves

    # ------------------------------------------------------------------ close events

    def _watch(self, save: SaveInProgress) -> None:
        try:
            from watchdog.events import FileClosedEvent, FileSystemEvent, FileSystemEventHandler
            from watchdog.observers import Observer
        except ImportError:  # pragma: no cover - watchdog is in the [upload] extra
            return
        watcher, base = self, str(save.path)

        class Handler(FileSystemEventHandler):
            def on_any_event(self, event: FileSystemEvent) -> None:
                if isinstance(event, FileClosedEvent) and not event.is_directory:
                    watcher._closed(save, base, str(event.src_path))

        observer = Observer()
        try:
            observer.schedule(Handler(), base, recursive=True)
            observer.daemon = True
            observer.start()
        except Exception as exc:  # inotify limits, an odd file system: the settle time
            log.debug("no close events for %s (%s); waiting for files to settle", base, exc)
            return
        self._observers[save.folder] = observer

    def _closed(self, save: SaveInProgress, base: str, path: str) -> None:
        try:
            key = stat_key(os.lstat(path))
        except OSError:
            return
        relative = os.path.relpath(path, base).replace(os.sep, "/")
        with self._lock:
            save.closed[relative] = key
        self._on_change()

    def _unwatch(self, ident: FolderId) -> None:
        observer = self._observers.pop(ident, None)
        if observer is not None:
            observer.stop()
            observer.join(1.0)
