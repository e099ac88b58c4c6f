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
staged files discarded) and, if it commits, sent whole. A followed save is walked from a
directory descriptor, each folder opened below the one above it with ``O_NOFOLLOW``
(never by path: a link swapped in for the folder is not followed), at most
``MAX_ENTRIES_PER_SAVE`` entries and ``MAX_DEPTH`` folders deep: a save beyond either is
no longer followed (and not looked into again while it is there); it goes up whole once
it commits.
"""

from __future__ import annotations

import logging
import os
import re
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Protocol

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

__all__ = ["DEFAULT_SETTLE_SECONDS", "MAX_DEPTH", "MAX_ENTRIES_PER_SAVE", "MAX_FOLDERS_WATCHED",
           "MAX_SAVES_FOLLOWED", "FolderId", "SaveInProgress", "StreamWatcher"]

log = logging.getLogger("sidecar.host.upload.stream")

DEFAULT_SETTLE_SECONDS = 1.0
# A trainer has one save in progress (two when a save overlaps a killed one's leftover);
# beyond a few, the folders are not saves worth sending early.
MAX_SAVES_FOLLOWED = 4
MAX_FOLDERS_WATCHED = 64  # per save: the save's folder and its subfolders; then settle time
# Files and folders looked at per save and scan: a save writes a file or two per rank it
# holds; a save beyond this is not worth sending early, and walking it every scan would
# cost the daemon more than sending it after the commit.
MAX_ENTRIES_PER_SAVE = 4096
MAX_DEPTH = 16  # folders below a save's own: a state dict nests a few, never more
# Saves not followed for their size, remembered (while they are there) so that they are not
# walked again: a few more than are followed at once.
_IGNORED_KEPT = 4 * MAX_SAVES_FOLLOWED
_DIRECTORY = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)
_NO_FOLLOW_DIRECTORY = _DIRECTORY | getattr(os, "O_NOFOLLOW", 0)
_FD_PATHS = Path("/proc/self/fd")  # an open folder watched as itself (Linux)
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
        self._ignored: OrderedDict[FolderId, str] = OrderedDict()  # not followed: why

    # ------------------------------------------------------------------ scanning

    def scan(self) -> list[SaveInProgress]:
        """Look again; returns the saves no longer followed since the last scan, ``dropped``
        saying why (abandoned, or pushed out by newer ones): their staging is the caller's
        to discard."""
        now = self._monotonic()
        found = self._temporary_folders()
        for ident in [ident for ident in self._ignored if ident not in found]:
            del self._ignored[ident]  # gone: a folder made again there is a new save
        newest = set(sorted(found, key=lambda ident: found[ident][2],
                            reverse=True)[:MAX_SAVES_FOLLOWED]) - set(self._ignored)
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
            try:
                self._look(self.saves[ident], now)
            except Exception as exc:  # too large, too deep, or what the job made of it
                why = str(exc) if isinstance(exc, _NotFollowed) else \
                    f"it could not be looked into ({type(exc).__name__})"
                dropped.append(self._drop(ident, why))
                self._ignored[ident] = why
                while len(self._ignored) > _IGNORED_KEPT:
                    self._ignored.popitem(last=False)
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
        """Note every regular file of ``save`` (walked from its descriptor) and since when
        it has been as it is; raises :class:`_NotFollowed` beyond the bounds."""
        top = self._open_save(save)
        if top is None:
            return  # gone, or another folder by that name now: the next scan decides
        seen: dict[str, tuple[StatKey, float]] = {}
        for relative, found in self._walk(save, top):
            if relative in _NOT_SENT or not stat.S_ISREG(found.st_mode):
                continue  # links and special files are never part of a checkpoint
            key = stat_key(found)
            old = save.keys.get(relative)
            seen[relative] = old if old is not None and old[0] == key else (key, now)
        save.keys = dict(sorted(seen.items()))  # by path: what ready() sends first

    def _open_save(self, save: SaveInProgress) -> Optional[int]:
        """The save's folder opened below the root without following a link, when it is
        still the folder first found (same device and inode); else None."""
        try:
            root = os.open(self.root, _DIRECTORY)
        except OSError:
            return None
        try:
            top = os.open(save.path.name, _NO_FOLLOW_DIRECTORY, dir_fd=root)
        except OSError:
            return None
        finally:
            os.close(root)
        found = os.fstat(top)
        if (found.st_dev, found.st_ino) != save.folder:
            os.close(top)
            return None
        return top

    def _walk(self, save: SaveInProgress, top: int) -> Iterator[tuple[str, os.stat_result]]:
        """Every entry below the open folder ``top`` (closed after), depth first: its path
        relative to the save and its ``lstat``. Each folder is opened below the one above
        it with ``O_NOFOLLOW``, and watched while it is open."""
        stack: list[tuple[int, _Listing, str]] = []
        count = 0
        try:
            self._enter(save, stack, top, "")
            while stack:
                directory, entries, prefix = stack[-1]
                entry = next(entries, None)
                if entry is None:
                    stack.pop()
                    _close(directory, entries)
                    continue
                count += 1
                if count > MAX_ENTRIES_PER_SAVE:
                    raise _NotFollowed(f"more than {MAX_ENTRIES_PER_SAVE} files and folders")
                try:
                    found = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                relative = prefix + entry.name
                if not stat.S_ISDIR(found.st_mode):
                    yield relative, found
                    continue
                if len(stack) > MAX_DEPTH:
                    raise _NotFollowed(f"folders more than {MAX_DEPTH} deep")
                try:
                    child = os.open(entry.name, _NO_FOLLOW_DIRECTORY, dir_fd=directory)
                except OSError:
                    continue  # gone, or no longer a folder
                self._enter(save, stack, child, relative + "/")
        finally:
            for directory, entries, _ in stack:
                _close(directory, entries)

    def _enter(self, save: SaveInProgress,
               stack: list[tuple[int, _Listing, str]],
               directory: int, prefix: str) -> None:
        """Watch and list the open folder ``directory`` (``prefix`` below the save); it
        is the stack's to close from now on."""
        try:
            entries = os.scandir(directory)
        except OSError:
            os.close(directory)
            return
        stack.append((directory, entries, prefix))
        self._watch_folder(save, directory, prefix)

    def ready(self) -> Optional[tuple[SaveInProgress, str, StatKey]]:
        """The next finished file to send: newest save first, then by path."""
        now = self._monotonic()
        for save in sorted(self.saves.values(), key=lambda s: s.created, reverse=True):
            if save.committed:
                continue
            with self._lock:
                closed = dict(save.closed)
            for relative, (key, since) in save.keys.items():  # by path (sorted once)
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

    def _watch_folder(self, save: SaveInProgress, directory: int, prefix: str) -> None:
        """Watch one open folder of a followed save on the shared instance (once): the
        folder opened, through its descriptor, not whatever its path names now."""
        if self._watch is None:
            return
        relative = prefix.rstrip("/") or "."  # "." for the save's own folder
        with self._lock:
            folders = self._folders.setdefault(save.folder, {})
            if relative in folders or len(folders) >= MAX_FOLDERS_WATCHED:
                return

        def on_event(wd: int, mask: int, name: str) -> None:
            if mask & IN_IGNORED:  # the folder went: forget it, a new one is watched anew
                with self._lock:
                    if folders.get(relative) == wd:
                        del folders[relative]
            elif mask & IN_ISDIR:
                self._on_change()  # a new subfolder: the next scan watches it
            elif mask & IN_CLOSE_WRITE and name:
                self._closed(save, prefix + name)

        if _FD_PATHS.is_dir():
            wd = self._watch.add(_FD_PATHS / str(directory), _SAVE_EVENTS & ~IN_DONT_FOLLOW,
                                 on_event)
        else:
            wd = self._watch.add(save.path / prefix, _SAVE_EVENTS, on_event)
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


class _Listing(Protocol):
    """What ``os.scandir`` returns: its entries, and ``close``."""

    def __next__(self) -> os.DirEntry[str]: ...

    def close(self) -> None: ...


class _NotFollowed(Exception):
    """Why a save is too large or too deep to follow."""


def _close(directory: int, entries: _Listing) -> None:
    entries.close()
    os.close(directory)
