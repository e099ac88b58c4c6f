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

The job's folder is hostile input (issue 35, item 4): however many folders it names like
saves, only the ``MAX_SAVES_FOLLOWED`` most recently changed are followed (looked into,
watched, sent early), on the uploader's one inotify instance, at most
``MAX_FOLDERS_WATCHED`` folders each. The others are ignored until they commit, when the
uploader sends them as any checkpoint; a save pushed out by newer ones is dropped (its
staged files discarded) and, if it commits, sent whole.
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
from typing import Callable, Optional

from sidecar.checkpoint.manifest import MANIFEST_NAME, PIN_MARKERS
from sidecar.host.upload.commit_check import Staging, StatKey, stat_key
from sidecar.host.upload.inotify import (
    IN_CLOSE_WRITE,
    IN_CREATE,
    IN_DONT_FOLLOW,
    IN_IGNORED,
    IN_ISDIR,
    IN_ONLYDIR,
)
from sidecar.host.upload.watch import FolderWatch

__all__ = ["DEFAULT_SETTLE_SECONDS", "MAX_FOLDERS_WATCHED", "MAX_SAVES_FOLLOWED", "FolderId",
           "SaveInProgress", "StreamWatcher"]

log = logging.getLogger("sidecar.host.upload.stream")

DEFAULT_SETTLE_SECONDS = 1.0
# A trainer has one save in progress (two when a save overlaps a killed one's leftover);
# beyond a few, the folders are not saves worth sending early.
MAX_SAVES_FOLLOWED = 4
MAX_FOLDERS_WATCHED = 64  # per save: the save's folder and its subfolders; then settle time
_SAVE_EVENTS = IN_CLOSE_WRITE | IN_CREATE | IN_ONLYDIR | IN_DONT_FOLLOW
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
    dropped: str = ""  # why it is no longer followed, once it is not
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
                 monotonic: Callable[[], float] = time.monotonic,
                 watch: Optional[FolderWatch] = None) -> None:
        self.root = root
        self.settle_seconds = settle_seconds
        self._on_change = on_change
        self._monotonic = monotonic
        self._watch = watch  # its inotify instance, shared: None means settle time only
        # Guards ``closed`` and ``_folders`` (written by the inotify thread too).
        self._lock = threading.Lock()
        self.saves: dict[FolderId, SaveInProgress] = {}
        self._folders: dict[FolderId, dict[str, int]] = {}  # watched: relative folder -> wd

    # ------------------------------------------------------------------ scanning

    def scan(self) -> list[SaveInProgress]:
        """Look again; returns the saves no longer followed since the last scan, ``dropped``
        saying why (abandoned, or pushed out by newer ones): their staging is the caller's
        to discard."""
        now = self._monotonic()
        found = self._temporary_folders()
        newest = set(sorted(found, key=lambda ident: found[ident][2],
                            reverse=True)[:MAX_SAVES_FOLLOWED])
        dropped = []
        for ident, save in list(self.saves.items()):
            if save.committed:  # the uploader takes it next, unless it went again
                if folder_id(self.root / save.name) != ident:
                    dropped.append(self._drop(ident, f"{save.name} is gone"))
            elif ident in newest:
                continue
            elif ident in found:
                dropped.append(self._drop(ident, f"{MAX_SAVES_FOLLOWED} newer saves are "
                                                 "in progress"))
            elif folder_id(self.root / save.name) == ident:
                save.committed = True  # renamed into place; the uploader takes it next
                self._unwatch(ident)
            else:
                dropped.append(self._drop(ident, f"{save.path.name} is gone"))
        for ident in newest:
            if ident not in self.saves:
                path, name, _ = found[ident]
                self.saves[ident] = SaveInProgress(path, name, ident, now)
            self._look(self.saves[ident], now)
        waiting = sorted((save for save in self.saves.values() if save.committed),
                         key=lambda save: save.created)
        for save in waiting[:-MAX_SAVES_FOLLOWED]:  # committed, never taken: bounded too
            dropped.append(self._drop(save.folder, f"{save.name} was never taken"))
        return dropped

    def _temporary_folders(self) -> dict[FolderId, tuple[Path, str, int]]:
        """Every folder named like a save in progress: its path, name and mtime."""
        found: dict[FolderId, tuple[Path, str, int]] = {}
        try:
            with os.scandir(self.root) as entries:
                for entry in entries:
                    match = _TEMP.match(entry.name)
                    if match is None:
                        continue
                    try:
                        info = entry.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    if stat.S_ISDIR(info.st_mode):
                        found[(info.st_dev, info.st_ino)] = (Path(entry.path), match["name"],
                                                             info.st_mtime_ns)
        except OSError:
            pass
        return found

    def _drop(self, ident: FolderId, why: str) -> SaveInProgress:
        save = self.saves.pop(ident)
        self._unwatch(ident)
        save.dropped = why
        return save

    def _look(self, save: SaveInProgress, now: float) -> None:
        seen: dict[str, tuple[StatKey, float]] = {}
        for current, dirnames, filenames in os.walk(save.path):
            dirnames.sort()
            self._watch_folder(save, current)
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
        for ident in list(self._folders):
            self._unwatch(ident)
        saves, self.saves = list(self.saves.values()), {}
        return saves

    # ------------------------------------------------------------------ close events

    def _watch_folder(self, save: SaveInProgress, current: str) -> None:
        """Watch one folder of a followed save on the shared instance (once)."""
        if self._watch is None:
            return
        relative = os.path.relpath(current, save.path)  # "." for the save's own folder
        with self._lock:
            folders = self._folders.setdefault(save.folder, {})
            if relative in folders or len(folders) >= MAX_FOLDERS_WATCHED:
                return
        prefix = "" if relative == "." else relative.replace(os.sep, "/") + "/"

        def on_event(wd: int, mask: int, name: str) -> None:
            if mask & IN_IGNORED:  # the folder went: forget it, a new one is watched anew
                with self._lock:
                    if folders.get(relative) == wd:
                        del folders[relative]
            elif mask & IN_ISDIR:
                self._on_change()  # a new subfolder: the next scan watches it
            elif mask & IN_CLOSE_WRITE and name:
                self._closed(save, prefix + name)

        wd = self._watch.add(Path(current), _SAVE_EVENTS, on_event)
        if wd is not None:
            with self._lock:
                folders[relative] = wd

    def _closed(self, save: SaveInProgress, relative: str) -> None:
        try:
            key = stat_key(os.lstat(save.path / relative))
        except OSError:
            return
        with self._lock:
            save.closed[relative] = key
        self._on_change()

    def _unwatch(self, ident: FolderId) -> None:
        with self._lock:
            folders = self._folders.pop(ident, {})
            wds = list(folders.values())
            folders.clear()
        if self._watch is not None:
            for wd in wds:
                self._watch.remove(wd)
