"""What the upload thread does while no checkpoint waits for its commit (``uploader``).

One piece per idle turn, in this order: send one finished file of a save in progress
(``stream``), else copy into the newest durable S3 checkpoint the unchanged files it still
reads from an older folder (``s3_refs``), else probe the link when due (``probe``). Each
piece gives way at once: the server-side copy and the probe to anything the folder does
(a checkpoint saved, a save begun: :meth:`IdleWork.should_stop`), a file sent early to the
daemon stopping or its save going away. The commit loop itself yields near the release by
``plan.gives_way``, the one rule the simulator runs too.

The newest durable checkpoint's files (``durable``) live here: the commit loop reuses them
for the unchanged files of the next checkpoint, streaming for the files of a save, and
the server-side copy makes them all the checkpoint's own.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Callable, Optional

from sidecar.checkpoint.manifest import Invalid
from sidecar.host.logs import printable
from sidecar.host.upload.commit_check import DurableFile, reuse
from sidecar.host.upload.destination import Destination
from sidecar.host.upload.probe import LinkProbe
from sidecar.host.upload.status import UploadTracker
from sidecar.host.upload.stream import FolderId, SaveInProgress, StreamWatcher, folder_id
from sidecar.host.upload.volume_stage import Cancelled
from sidecar.host.upload.watch import FolderWatch

__all__ = ["IdleWork"]

log = logging.getLogger("sidecar.host.upload")

_WARNED_KEPT = 64  # failures remembered (said once each); a job makes as many as it likes


class IdleWork:
    """Owned and run by the upload thread (``Uploader``): nothing here is thread-safe.

    ``stop`` and ``wake`` are the uploader's events (the daemon stops; the folder
    changed); ``failed`` is its backoff, for a destination that fails a file sent early."""

    def __init__(
        self,
        root: Path,
        destination: Destination,
        tracker: UploadTracker,
        *,
        stop: threading.Event,
        wake: threading.Event,
        watch: FolderWatch,
        failed: Callable[[Optional[str], str], None],
        clock: Callable[[], float],
        scan_interval_seconds: float,
        settle_seconds: float,
        stream: bool,
        probe: Optional[LinkProbe],
    ) -> None:
        self._root = root
        self._destination = destination
        self._tracker = tracker
        self._stop = stop
        self._wake = wake
        self._failed = failed
        self._clock = clock
        self._scan_interval = scan_interval_seconds
        self._settle = settle_seconds
        self._probe = probe
        self._stream = StreamWatcher(root, settle_seconds=settle_seconds, on_change=wake.set,
                                     watch=watch) if stream else None
        # The newest checkpoint this uploader made durable: its files, which an unchanged
        # file of the next one reuses (issue 23, item 2).
        self.durable: dict[str, DurableFile] = {}
        self._durable_name: Optional[str] = None  # whose files self.durable holds
        # Durable checkpoints whose unchanged files are still kept in an older folder:
        # made self-contained while idle (``s3_refs.materialize``).
        self._referring: list[str] = []
        self._warned: dict[str, str] = {}  # what failed in a scan, and why: said once

    # ------------------------------------------------------------------ for the commit loop

    def made_durable(self, name: str, files: dict[str, DurableFile]) -> None:
        """``name`` is durable with ``files``: the ones the next commit may reuse, and a
        reference to an older folder among them is copied in while idle."""
        self.durable = files
        self._durable_name = name
        if any(entry.checkpoint != name for entry in files.values()):
            self._referring = [other for other in self._referring if other != name] + [name]

    def measured(self) -> None:
        """An upload measured the link: the next probe is due a full interval later."""
        if self._probe is not None:
            self._probe.measured()

    def scan_saves(self) -> None:
        """Follow the saves in progress; one that is no longer followed (pushed out by
        newer ones, too large) loses its staged files. A failing scan must not stop
        committed checkpoints from going up: saves then wait for their commit (logged
        once per cause)."""
        if self._stream is None:
            return
        try:
            dropped = self._stream.scan()
        except Exception as exc:
            self._once("saves in progress", f"saves in progress are not sent early for now "
                       f"(they go up once committed): looking at them failed: {exc!r}")
            return
        for save in dropped:
            log.info("the save of %s is no longer followed (%s); its %d staged file(s) "
                     "are discarded", save.name, save.dropped,
                     len(save.staging.files) if save.staging else 0)
            self.discard(save)

    def take(self, folder: Path, name: str) -> Optional[SaveInProgress]:
        """The save that became ``name`` (its files sent early), now the loop's to commit."""
        if self._stream is None:
            return None
        ident: Optional[FolderId] = folder_id(folder)
        return None if ident is None else self._stream.take(ident, name)

    def discard(self, save: SaveInProgress) -> None:
        """Remove ``save``'s staged files from the destination (never committed)."""
        if save.staging is None:
            return
        try:
            save.staging.discard()
        except Exception as exc:
            log.warning("could not discard the staged files of %s: %s", save.name,
                        self._destination.describe_error(exc, "discarding"))
        save.staging = None

    def close(self) -> None:
        """The thread has stopped: staged files of saves never committed are not kept."""
        if self._stream is not None:
            for save in self._stream.stop():
                self.discard(save)

    # ------------------------------------------------------------------ one idle turn

    def run(self) -> float:
        """One piece of idle work; returns how long the thread may sleep (0: more to do)."""
        if self._stream_once():
            return 0.0
        if self._referring:
            self._self_contain(self._referring[-1])
            return 0.0
        if self._probe is not None:
            self._probe.run_if_due(self.should_stop)
        return self._idle_seconds()

    def should_stop(self) -> Optional[str]:
        """Idle work (a probe, a server-side copy of unchanged files) gives way to anything
        the folder does (a checkpoint saved, a save begun): the upload thread must not be
        busy with it when there is a file to send."""
        if self._stop.is_set():
            return "stopping"
        return "the checkpoint folder changed" if self._wake.is_set() else None

    def _stream_once(self) -> bool:
        """Send one finished file of a save in progress. True when there was one."""
        if self._stream is None:
            return False
        found = self._stream.ready()
        if found is None:
            return False
        save, relative, key = found
        save.tried[relative] = key  # whatever happens, not again at this key
        started = time.monotonic()
        try:
            if save.staging is None:
                save.staging = self._destination.open_staging(save.name)
            staged = reuse(save.staging, save.path, relative, key[1], None, self.durable)
            if staged is None:
                before = save.sent_bytes

                def progress(count: int) -> None:
                    save.sent_bytes += count
                    self._tracker.add_progress(save.name, count)  # no record yet: the total

                staged = save.staging.send(save.path, relative, on_progress=progress,
                                           should_stop=lambda: self._stream_stop(save))
                if staged is None:
                    save.sent_bytes = before
            if staged is not None and staged.key != key:
                save.tried[relative] = staged.key
        except Cancelled as exc:
            save.tried.pop(relative, None)
            log.info("stopped sending %s/%s early: %s", save.name, relative, exc)
        except (Invalid, FileNotFoundError, NotADirectoryError) as exc:
            log.debug("not sending %s/%s early: %s", save.name, relative, exc)
        except Exception as exc:  # the destination: backed off as any upload failure
            save.tried.pop(relative, None)
            self._failed(None, self._destination.describe_error(
                exc, f"sending {save.name}/{relative} early"))
        save.send_seconds += time.monotonic() - started
        return True

    def _stream_stop(self, save: SaveInProgress) -> Optional[str]:
        if self._stop.is_set():
            return "the daemon is stopping"
        if not save.path.exists() and folder_id(self._root / save.name) != save.folder:
            return "the save's folder is gone"
        return None

    def _self_contain(self, name: str) -> None:
        """Copy server-side what ``name`` refers to; it gives way as all idle work does."""
        try:
            copied = self._destination.make_self_contained(name, self.should_stop)
        except Cancelled:
            return  # again once idle
        except Exception as exc:
            log.warning("%s still reads unchanged files from an older folder, which must "
                        "stay: %s", name, self._destination.describe_error(
                            exc, f"copying {name}'s unchanged files into its folder"))
        else:
            if copied:
                log.info("%s is self-contained: %d unchanged file(s) copied into its folder "
                         "on the server side", name, copied)
            if name == self._durable_name:  # every file is in its own folder now
                self.durable = {path: DurableFile(name, entry.size, entry.sha256)
                                for path, entry in self.durable.items()}
        self._referring.remove(name)

    def _idle_seconds(self) -> float:
        now = self._clock()
        waits = [self._scan_interval]
        for record in self._tracker.records():
            if record.state == "failed" and record.retry_at_unix is not None:
                waits.append(max(0.0, record.retry_at_unix - now))
        if self._stream is not None and self._stream.waiting():
            waits.append(self._settle / 4)  # files may settle meanwhile
        probe_in = None if self._probe is None else self._probe.due_in()
        if probe_in is not None:
            waits.append(probe_in)
        return max(0.01, min(waits))

    def _once(self, what: str, message: str) -> None:
        """One warning per ``what`` and message (the same again at debug level)."""
        level = logging.DEBUG if self._warned.get(what) == message else logging.WARNING
        if level == logging.WARNING:
            self._warned[what] = message
            while len(self._warned) > _WARNED_KEPT:
                self._warned.pop(next(iter(self._warned)))
        log.log(level, "%s", printable(message))
