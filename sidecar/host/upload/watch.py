"""Wake the uploader when something changes in the checkpoint folder.

One inotify instance (:mod:`~sidecar.host.upload.inotify`) for the root folder and for
every save in progress the stream watcher follows: the job's folder is hostile input, and
however many folders it makes, the daemon holds one instance and one reader thread (issue
35, item 4). The root is watched alone, not recursively: a save in progress writes into a
hidden temporary folder, and the commit is a rename into the root, which is what matters.
The uploader also rescans every few seconds, so a watch that cannot be set up (the folder
does not exist yet, inotify limits, a network file system that sends no events) costs
latency, never correctness.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable, Optional

from sidecar.host.upload.inotify import FOLDER_EVENTS, IN_IGNORED, IN_ONLYDIR, Handler, Inotify

__all__ = ["FolderWatch"]

log = logging.getLogger("sidecar.host.upload.watch")


class FolderWatch:
    """The root folder, watched; :meth:`add` lends the same instance to other watchers."""

    def __init__(self, root: Path, on_change: Callable[[], None]) -> None:
        self.root = root
        self._on_change = on_change
        self._inotify: Optional[Inotify] = None
        self._root_wd: Optional[int] = None
        self._reported: Optional[str] = None

    @property
    def active(self) -> bool:
        return self._root_wd is not None and self._inotify is not None and self._inotify.alive

    def watches(self) -> int:
        """How many folders the shared instance watches now (the root's included)."""
        return self._inotify.watches() if self._inotify is not None else 0

    def ensure(self) -> bool:
        """Start watching if not yet (cheap when already watching). True when watching."""
        if self.active:
            return True
        if not self.root.is_dir():
            self._report(f"{self.root} does not exist yet; polling until it does")
            return False
        inotify = self._instance()
        if inotify is None:
            return False
        try:
            self._root_wd = inotify.add(str(self.root), FOLDER_EVENTS | IN_ONLYDIR,
                                        self._root_event)
        except OSError as exc:  # inotify limits, permissions, an odd file system
            self._report(f"cannot watch {self.root} ({type(exc).__name__}: {exc}); polling")
            return False
        self._reported = None
        log.debug("watching %s", self.root)
        return True

    def add(self, path: Path, mask: int, handler: Handler) -> Optional[int]:
        """Watch ``path`` on the shared instance; None when it cannot be (then the caller
        polls). Only while the root is watched: nothing here outlives :meth:`stop`."""
        if not self.active or self._inotify is None:
            return None
        try:
            return self._inotify.add(str(path), mask, handler)
        except OSError as exc:
            log.debug("cannot watch %s (%s)", path, exc)
            return None

    def remove(self, wd: int) -> None:
        if self._inotify is not None:
            self._inotify.remove(wd)

    def stop(self, timeout: float = 2.0) -> None:
        inotify, self._inotify, self._root_wd = self._inotify, None, None
        if inotify is not None:
            inotify.close(timeout)

    def _instance(self) -> Optional[Inotify]:
        """The one instance, opened once: if its reader ever ends, polling from then on
        (a second instance would give watches numbers the first one's holders still
        keep)."""
        if self._inotify is None:
            try:
                self._inotify = Inotify.open(on_overflow=self._on_change)
            except OSError as exc:
                self._report(f"no inotify ({exc}); polling instead")
                return None
        return self._inotify if self._inotify.alive else None

    def _root_event(self, wd: int, mask: int, name: str) -> None:
        if mask & IN_IGNORED:  # the root was deleted or unmounted: the next ensure() retries
            self._root_wd = None
        self._on_change()

    def _report(self, message: str) -> None:
        if message != self._reported:  # once per change, not every scan
            log.info("%s", message)
            self._reported = message
