"""Wake the uploader when something changes in the checkpoint folder.

inotify through watchdog, on the root folder only (not recursive: a save in progress
writes into a hidden temporary folder, and the commit is a rename into the root, which
is what matters). The uploader also rescans every few seconds, so a watch that cannot be
set up (the folder does not exist yet, inotify limits, a network file system that sends
no events) costs latency, never correctness.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable, Optional

__all__ = ["FolderWatch"]

log = logging.getLogger("sidecar.host.upload.watch")


class FolderWatch:
    def __init__(self, root: Path, on_change: Callable[[], None]) -> None:
        self.root = root
        self._on_change = on_change
        self._observer: Optional[Any] = None
        self._reported: Optional[str] = None

    @property
    def active(self) -> bool:
        return self._observer is not None and self._observer.is_alive()

    def ensure(self) -> bool:
        """Start watching if not yet (cheap when already watching). True when watching."""
        if self.active:
            return True
        self.stop()
        if not self.root.is_dir():
            self._report(f"{self.root} does not exist yet; polling until it does")
            return False
        try:
            from watchdog.events import FileSystemEvent, FileSystemEventHandler
            from watchdog.observers import Observer
        except ImportError as exc:  # pragma: no cover - watchdog is in the [server] extra
            self._report(f"watchdog is not installed ({exc}); polling instead")
            return False

        on_change = self._on_change

        class Handler(FileSystemEventHandler):
            def on_any_event(self, event: FileSystemEvent) -> None:
                on_change()

        observer = Observer()
        try:
            observer.schedule(Handler(), str(self.root), recursive=False)
            observer.daemon = True
            observer.start()
        except Exception as exc:  # inotify limits, permissions, an odd file system
            self._report(f"cannot watch {self.root} ({type(exc).__name__}: {exc}); polling")
            return False
        self._observer = observer
        self._reported = None
        log.debug("watching %s", self.root)
        return True

    def _report(self, message: str) -> None:
        if message != self._reported:  # once per change, not every scan
            log.info("%s", message)
            self._reported = message

    def stop(self, timeout: float = 2.0) -> None:
        observer, self._observer = self._observer, None
        if observer is not None:
            observer.stop()
            observer.join(timeout)
