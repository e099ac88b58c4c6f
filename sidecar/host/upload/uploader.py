"""The daemon's upload thread: each complete local checkpoint to storage, newest first.

A cycle: scan the checkpoint root (``list_checkpoints``: manifest present, sizes match),
pick the newest checkpoint not yet durable, commit it at the destination (the files
sent while it was saved checked, the others sent: ``commit_check.complete``, manifest
last), repeat; with nothing to commit, send one finished file of a save in progress
(``stream``), else copy into a durable S3 checkpoint the unchanged files it still reads
from an older folder (``s3_refs``), else probe the link when due (``probe``); sleep until
the folder changes (inotify) or the next rescan.

- Newest first. A newer checkpoint goes before older pending ones, and once a checkpoint
  is durable every older one still waiting is skipped: resuming needs only the newest.
  Normally an upload in progress finishes first; when the release is near (remaining
  seconds below ``near_release_seconds``) it yields at once to the newest checkpoint,
  unless both still end before the release, this one first (the final checkpoint, then
  the top-up save after it). The rule and the estimate are ``plan``'s, the simulator's too.
- Pins. ``.uploading`` is created in the local folder before the first byte goes and
  removed after, so ``atomic_checkpoint(keep_last=...)`` never deletes a folder that is
  being uploaded. It is created exclusively without following a link and removed only
  while it is still the file this run created (``jobfiles.pin``); an entry of that name
  already there is left alone (it pins the folder as well). A daemon killed mid-upload
  leaves its marker; the next start removes markers it wrote (``clear_stale_pin``), and
  uploads that folder again if it is still the one to upload.
- The job's files are hostile input: every one is read through ``jobfiles``; a file it
  refuses (a link, hard-linked, another user's) makes the checkpoint not durable, with
  one reason line (state ``skipped``) until the job saves it again.
- Failures. An attempt that fails is retried after an exponential backoff with jitter
  (``backoff_base_seconds`` doubling up to ``backoff_cap_seconds``, times 0.5-1.0); the
  status says degraded with the error until a storage call succeeds again. Local
  checkpoints are never deleted because of an upload failure.
- Restarts. Multipart uploads under the prefix that an earlier run left unfinished are
  aborted once per start (one prefix belongs to one uploader). A checkpoint whose remote
  manifest equals the local one is already durable and is not uploaded again.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Protocol

from sidecar.checkpoint.folders import CheckpointInfo, list_checkpoints, prune
from sidecar.checkpoint.manifest import MANIFEST_NAME, UPLOADING_MARKER, Invalid
from sidecar.host.logs import printable
from sidecar.host.settings import (
    DEFAULT_UPLOAD_NEAR_RELEASE_SECONDS,
    DEFAULT_UPLOAD_SCAN_INTERVAL_SECONDS,
)
from sidecar.host.upload import plan
from sidecar.host.upload.commit_check import DurableFile, Staging, reuse
from sidecar.host.upload.jobfiles import Pin, Refused, clear_stale_pin, pin, read_job_file, unpin
from sidecar.host.upload.location import S3Location
from sidecar.host.upload.probe import LinkProbe
from sidecar.host.upload.status import UploadRecord, UploadTracker
from sidecar.host.upload.storage import StorageConfig, make_client
from sidecar.host.upload.stream import (
    DEFAULT_SETTLE_SECONDS,
    SaveInProgress,
    StreamWatcher,
    folder_id,
)
from sidecar.host.upload.transfer import S3Destination, manifest_digest
from sidecar.host.upload.volume import Cancelled
from sidecar.host.upload.watch import FolderWatch

__all__ = ["MARKER_NAME", "Destination", "Uploader", "UploaderConfig"]


class Destination(Protocol):
    """Where complete checkpoints go: S3 / TOS (``transfer.S3Destination``) or a mounted
    volume (``volume.VolumeDestination``). Each keeps the manifest-last guarantee."""

    @property
    def url(self) -> str: ...

    @property
    def endpoint(self) -> Optional[str]: ...

    @property
    def where(self) -> str: ...

    def prepare(self, started_at_unix: float) -> None: ...

    def remote_manifest(self, name: str) -> Optional[bytes]: ...

    def upload(self, info: CheckpointInfo, manifest: bytes, *,
               on_progress: Callable[[int], None], should_stop: Callable[[], Optional[str]],
               before_manifest: Callable[[], None], staging: Optional[Staging] = None,
               durable: Mapping[str, DurableFile] = ...) -> None: ...

    def describe_error(self, exc: BaseException, doing: str) -> str: ...

    def reset(self) -> None: ...

    def open_staging(self, name: str) -> Staging:
        """Where ``name``'s files go before its manifest lands (nothing visible)."""
        ...

    def durable_files(self, name: str) -> dict[str, DurableFile]:
        """The files of the durable checkpoint ``name`` with a known sha256."""
        ...

    def probe(self, amount: int, should_stop: Callable[[], Optional[str]]) -> None:
        """Send ``amount`` bytes where nothing reads them (``probe.LinkProbe``)."""
        ...

    def make_self_contained(self, name: str, should_stop: Callable[[], Optional[str]]) -> int:
        """Bring into ``name``'s folder the files it refers to elsewhere (``s3_refs``)."""
        ...

log = logging.getLogger("sidecar.host.upload")

MARKER_NAME = UPLOADING_MARKER  # pins the folder against retention while it uploads
_MARKER_TEXT = "esi-sidecar uploader"  # first words of markers this uploader writes
# Note on a record whose folder vanished (pruned, or moved aside by a re-save that a kill
# interrupted: if it comes back, it is considered again).
_GONE = "the local checkpoint is gone"
_INVALID = "not valid: "  # then why: considered again when it is valid again
_REFUSED = "not durable: "  # then which job file was refused: again once saved again
_WARNED_KEPT = 64  # failures remembered (said once each); a job makes as many as it likes


@dataclass(frozen=True)
class UploaderConfig:
    root: Path
    location: Optional[S3Location]  # None when the destination is given (a mounted volume)
    storage: StorageConfig = field(default_factory=StorageConfig)
    keep_local: Optional[int] = None  # prune durable checkpoints beyond the N newest
    near_release_seconds: float = DEFAULT_UPLOAD_NEAR_RELEASE_SECONDS
    scan_interval_seconds: float = DEFAULT_UPLOAD_SCAN_INTERVAL_SECONDS
    backoff_base_seconds: float = 1.0
    backoff_cap_seconds: float = 60.0
    # Send each file of a save in progress once finished (issue 23, item 1); off: only
    # committed checkpoints, as before (the benchmark's baseline).
    stream: bool = True
    settle_seconds: float = DEFAULT_SETTLE_SECONDS
    # Probe the link while idle (probe.py); off: the estimate only learns from uploads.
    probe: bool = True


class _Stale(Exception):
    """The local folder changed under the upload (re-saved, deleted): start over."""


class Uploader:
    """Start with :meth:`start`, stop with :meth:`stop`; the tracker holds the status."""

    def __init__(
        self,
        config: UploaderConfig,
        *,
        tracker: Optional[UploadTracker] = None,
        remaining_seconds: Callable[[], Optional[float]] = lambda: None,
        client_factory: Callable[[StorageConfig], Any] = make_client,
        clock: Callable[[], float] = time.time,
        destination: Optional[Destination] = None,
    ) -> None:
        self.config = config
        # S3 / TOS from the config unless another destination (a mounted volume) is given.
        if destination is None:
            if config.location is None:
                raise ValueError("an S3 location or a destination is needed")
            destination = S3Destination(config.storage, config.location, client_factory)
        self.destination: Destination = destination
        self.tracker = tracker or UploadTracker(
            source=str(config.root), destination=self.destination.url,
            endpoint=self.destination.endpoint, max_bandwidth=config.storage.max_bandwidth,
            clock=clock,
        )
        self._remaining = remaining_seconds
        self._clock = clock
        self._probe = LinkProbe(self.destination, self.tracker,
                                remaining_seconds=remaining_seconds,
                                near_release_seconds=config.near_release_seconds,
                                ) if config.probe else None
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._watch = FolderWatch(config.root, self.wake)
        self._stream = StreamWatcher(config.root, settle_seconds=config.settle_seconds,
                                     on_change=self.wake,
                                     watch=self._watch) if config.stream else None
        # The newest checkpoint this uploader made durable: its files, which an unchanged
        # file of the next one reuses (issue 23, item 2).
        self._durable: dict[str, DurableFile] = {}
        # Durable checkpoints whose unchanged files are still kept in an older folder:
        # made self-contained while idle (``s3_refs.materialize``).
        self._referring: list[str] = []
        self._durable_name: Optional[str] = None  # whose files self._durable holds
        self._started_at = clock()
        self._prepared = False
        self._storage_retry_at = 0.0
        self._failures_in_a_row = 0
        self._last_failure: Optional[str] = None
        self._refused: dict[str, str] = {}  # committed checkpoints no longer valid: why
        self._warned: dict[str, str] = {}  # what failed in a scan, and why: said once
        self._last_scan = 0.0  # time.monotonic() of the last scan
        self._last_scan_at: Optional[float] = None  # the same on self._clock, once done

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("the uploader is already started")
        self._started_at = self._clock()
        self._clear_stale_markers()
        self._thread = threading.Thread(target=self._run, name="esi-sidecar-upload", daemon=True)
        self._thread.start()
        log.info("uploading complete checkpoints from %s to %s (%s)", self.config.root,
                 self.destination.url, self.destination.where)

    def stop(self, timeout: float = 2.0) -> None:
        """Stop soon: an upload in progress is cancelled (it restarts on the next start).

        ``timeout`` bounds the whole stop, the watcher's included (the daemon's shutdown
        shares one budget across everything it joins)."""
        stop_by = time.monotonic() + timeout
        self._stop.set()
        self._wake.set()
        self._watch.stop(timeout=max(0.1, timeout / 2))
        if self._thread is not None:
            self._thread.join(max(0.1, stop_by - time.monotonic()))
            if self._thread.is_alive():
                log.warning("the upload thread did not stop within %.0f s", timeout)
                return
        if self._stream is not None:  # staged files of saves never committed: not kept
            for save in self._stream.stop():
                self._discard(save)

    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wake(self) -> None:
        """Something changed in the folder: rescan now."""
        self._wake.set()

    # ------------------------------------------------------------------ the loop

    def _run(self) -> None:
        while not self._stop.is_set():
            # Clear before the scan, not after the wait: a wake-up that arrives during
            # the scan then still cuts the next wait short instead of being lost.
            self._wake.clear()
            try:
                wait = self._cycle()
            except Exception:  # a bug must not end uploads for the daemon's lifetime
                log.exception("upload cycle failed")
                wait = self.config.scan_interval_seconds
            if wait > 0:
                self._wake.wait(wait)

    def _cycle(self) -> float:
        """One scan and at most one upload attempt. Returns how long to sleep."""
        self._watch.ensure()
        # Local first: /v1/uploads lists every complete checkpoint as pending even while
        # storage cannot be reached.
        self._scan()
        now = self._clock()
        if now < self._storage_retry_at:
            return min(self.config.scan_interval_seconds, self._storage_retry_at - now)
        if not self._prepared:
            try:
                self.destination.prepare(self._started_at)
                self.tracker.storage_ok()
            except Exception as exc:
                self._failed(None, self.destination.describe_error(exc, "preparing"))
                return 0.0
            self._prepared = True
        if self._stream is not None:
            for save in self._scan_saves():
                log.info("the save of %s is no longer followed (%s); its %d staged file(s) "
                         "are discarded", save.name, save.dropped,
                         len(save.staging.files) if save.staging else 0)
                self._discard(save)
        record = self._next()
        if record is None:
            if self._stream_once():
                return 0.0
            if self._referring:
                self._self_contain(self._referring[-1])
                return 0.0
            if self._probe is not None:
                self._probe.run_if_due(self._idle_work_should_stop)
            return self._idle_seconds()
        self._attempt(record)
        return 0.0

    def _scan_saves(self) -> list[SaveInProgress]:
        """The stream's scan, which must not stop committed checkpoints from going up:
        should it fail, saves in progress wait for their commit (logged once per cause)."""
        assert self._stream is not None
        try:
            return self._stream.scan()
        except Exception as exc:
            self._once("saves in progress", f"saves in progress are not sent early for now "
                       f"(they go up once committed): looking at them failed: {exc!r}")
            return []

    def _once(self, what: str, message: str) -> None:
        """One warning per ``what`` and message (the same again at debug level)."""
        level = logging.DEBUG if self._warned.get(what) == message else logging.WARNING
        if level == logging.WARNING:
            self._warned[what] = message
            while len(self._warned) > _WARNED_KEPT:
                self._warned.pop(next(iter(self._warned)))
        log.log(level, "%s", printable(message))

    def _self_contain(self, name: str) -> None:
        """Copy server-side what ``name`` refers to; it gives way as all idle work does."""
        try:
            copied = self.destination.make_self_contained(name, self._idle_work_should_stop)
        except Cancelled:
            return  # again once idle
        except Exception as exc:
            log.warning("%s still reads unchanged files from an older folder, which must "
                        "stay: %s", name, self.destination.describe_error(
                            exc, f"copying {name}'s unchanged files into its folder"))
        else:
            if copied:
                log.info("%s is self-contained: %d unchanged file(s) copied into its folder "
                         "on the server side", name, copied)
            if name == self._durable_name:  # every file is in its own folder now
                self._durable = {path: DurableFile(name, entry.size, entry.sha256)
                                 for path, entry in self._durable.items()}
        self._referring.remove(name)

    def _note_references(self, name: str) -> None:
        self._durable_name = name
        if any(entry.checkpoint != name for entry in self._durable.values()):
            self._referring = [other for other in self._referring if other != name] + [name]

    def _idle_work_should_stop(self) -> Optional[str]:
        """Idle work (a probe, a server-side copy of unchanged files) gives way to anything
        the folder does (a checkpoint saved, a save begun): the upload thread must not be
        busy with it when there is a file to send."""
        if self._stop.is_set():
            return "stopping"
        return "the checkpoint folder changed" if self._wake.is_set() else None

    def _idle_seconds(self) -> float:
        now = self._clock()
        waits = [self.config.scan_interval_seconds]
        for record in self.tracker.records():
            if record.state == "failed" and record.retry_at_unix is not None:
                waits.append(max(0.0, record.retry_at_unix - now))
        if self._stream is not None and self._stream.waiting():
            waits.append(self.config.settle_seconds / 4)  # files may settle meanwhile
        probe_in = None if self._probe is None else self._probe.due_in()
        if probe_in is not None:
            waits.append(probe_in)
        return max(0.01, min(waits))

    # ------------------------------------------------------------------ scanning

    def _local(self) -> list[CheckpointInfo]:
        """Complete local checkpoints (manifest present, sizes match), newest first."""
        return [listing.info for listing in list_checkpoints(self.config.root)
                if listing.info is not None]

    def _scan(self) -> None:
        self._last_scan = time.monotonic()
        scan_at = self._clock()  # before the listing: what it misses appeared after this
        listings = list_checkpoints(self.config.root)
        local = [listing.info for listing in listings if listing.info is not None]
        # Committed once (a manifest is there) but no longer valid: a file changed, or was
        # replaced by a link (issue 22, item 3). Partial saves are not worth a line.
        refused = {listing.path.name: listing.reason or "not valid" for listing in listings
                   if listing.info is None and os.path.lexists(listing.path / MANIFEST_NAME)}
        manifests: dict[str, bytes] = {}
        for info in local:
            try:
                manifests[info.name] = read_job_file(info.path, MANIFEST_NAME)
            except Invalid as exc:
                refused[info.name] = str(exc)
            except OSError:
                continue  # went away between the listing and now
            except Exception as exc:  # one folder must not stop the others going up
                refused[info.name] = f"its manifest could not be read ({exc!r})"
        for name, reason in refused.items():
            if self._refused.get(name) != reason:  # once per checkpoint and reason
                log.warning("not uploading %s: %s", printable(name), printable(reason))
        self._refused = refused
        seen = set()
        for info in local:
            if info.name not in manifests:
                continue
            seen.add(info.name)
            raw = manifests[info.name]
            digest = manifest_digest(raw)
            old = self.tracker.get(info.name)
            if old is not None and old.digest == digest and old.note != _GONE \
                    and not (old.note or "").startswith(_INVALID):
                continue
            if old is not None:
                log.info("%s was saved again; it will be uploaded again", info.name)
            self.tracker.put(UploadRecord(
                name=info.name, step=info.step, created_at_unix=info.created_at.timestamp(),
                digest=digest, bytes_total=info.total_bytes, file_count=len(info.files),
                appeared_after_unix=self._last_scan_at,
            ))
        for record in self.tracker.records():
            if record.name not in seen and record.state in ("pending", "failed"):
                # Deleted (pruned by the trainer, say) before its turn: nothing to upload.
                # Or no longer valid (a file changed, replaced by a link): say why, once.
                why = refused.get(record.name)
                self.tracker.update(record.name, state="skipped", retry_at_unix=None,
                                    note=_GONE if why is None else _INVALID + printable(why))
        self._last_scan_at = scan_at
        self._skip_superseded()

    def _skip_superseded(self) -> None:
        durable = self.tracker.last_durable()
        if durable is None:
            return
        for record in self.tracker.records():
            if record.state in ("pending", "failed") and durable.newer_than(record):
                self.tracker.update(
                    record.name, state="skipped", retry_at_unix=None,
                    note=f"superseded: {durable.name} (step {durable.step}) is durable",
                )

    def _next(self) -> Optional[UploadRecord]:
        now = self._clock()
        for record in self.tracker.records():  # newest first
            if record.state == "pending":
                return record
            if record.state == "failed" and (record.retry_at_unix or 0.0) <= now:
                return record
            if record.state == "failed":
                return None  # the newest is backing off: do not hammer storage with older
        return None

    # ------------------------------------------------------------------ one attempt

    def _attempt(self, record: UploadRecord) -> None:
        folder = self.config.root / record.name
        try:
            raw = read_job_file(folder, MANIFEST_NAME)
            inode = os.stat(folder, follow_symlinks=False).st_ino
        except (OSError, Invalid):
            self.tracker.update(record.name, state="skipped", note=_GONE)
            return
        if manifest_digest(raw) != record.digest:
            return  # re-saved since the scan; the next scan picks up the new one
        info = next((i for i in self._local() if i.name == record.name), None)
        if info is None:
            return  # no longer complete (being replaced): the next scan decides
        ident = folder_id(folder)
        save = (self._stream.take(ident, record.name)
                if self._stream is not None and ident is not None else None)
        streamed = save.sent_bytes if save is not None else 0
        self.tracker.update(
            record.name, state="uploading", attempts=record.attempts + 1,
            bytes_done=min(streamed, record.bytes_total),
            bytes_at_start=min(streamed, record.bytes_total),
            started_at_unix=self._clock(), finished_at_unix=None, error=None, note=None,
        )
        started = time.monotonic()
        pinned = self._pin(folder)
        shown = printable(record.name)
        try:
            remote = self.destination.remote_manifest(record.name)
            self.tracker.storage_ok()
            if remote == raw:
                if save is not None:
                    self._discard(save)
                self.tracker.record_done(record.name, duration=None,
                                         note="already complete in storage")
                log.info("%s is already complete in %s", record.name, self.destination.url)
                self._durable = self.destination.durable_files(record.name)
                self._note_references(record.name)
                self._succeeded()
            else:
                sent = self._upload(record, info, raw, folder, inode, save)
                self._note_references(record.name)
                duration = time.monotonic() - started
                self.tracker.record_done(
                    record.name, duration=duration, note=None, sent_after_save=sent,
                    sent=streamed + sent,
                    send_seconds=(save.send_seconds if save else 0.0) + duration)
                if self._probe is not None:
                    self._probe.measured()
                log.info("uploaded %s (%d bytes, %d files; %d bytes sent after the save, %d "
                         "before) to %s in %.1f s after the save", record.name,
                         info.total_bytes, len(info.files), sent, streamed,
                         self.destination.url, duration)
                self._succeeded()
        except Cancelled as exc:
            self.tracker.update(record.name, state="pending", note=str(exc), bytes_done=0)
            log.info("upload of %s stopped: %s", record.name, exc)
        except _Stale as exc:
            self.tracker.update(record.name, state="pending", note=str(exc), bytes_done=0)
            log.info("upload of %s restarts: %s", shown, exc)
        except Refused as exc:  # the job's folder holds a file the daemon must not read
            self.tracker.update(record.name, state="skipped", retry_at_unix=None,
                                note=_REFUSED + str(exc), bytes_done=0)
            log.warning("%s is not durable: %s", shown, exc)
        except Exception as exc:
            self._failed(record.name,
                         self.destination.describe_error(exc, f"uploading {record.name}"))
        finally:
            if pinned is not None:
                self._unpin(pinned)
        self._skip_superseded()
        after = self.tracker.get(record.name)
        if after is not None and after.state == "done":
            self._keep_local()

    def _upload(self, record: UploadRecord, info: CheckpointInfo, raw: bytes,
                folder: Path, inode: int, save: Optional[SaveInProgress]) -> int:
        """Commit ``record``: the files sent while it was saved are checked, the others
        sent (or copied from the last durable checkpoint). Returns the bytes sent now."""
        def unchanged() -> None:
            try:
                same = (os.stat(folder, follow_symlinks=False).st_ino == inode
                        and manifest_digest(read_job_file(folder, MANIFEST_NAME)) == record.digest)
            except (OSError, Invalid):
                same = False
            if not same:
                raise _Stale("the local checkpoint was replaced or removed during the upload")

        sent = [0]

        def progress(count: int) -> None:
            sent[0] += count
            self.tracker.add_progress(record.name, count)

        staging = save.staging if save is not None else None
        if staging is None:
            staging = self.destination.open_staging(record.name)
        self.destination.upload(
            info, raw, on_progress=progress, should_stop=lambda: self._should_yield(record),
            before_manifest=unchanged, staging=staging, durable=self._durable,
        )
        self._durable = {staged.path: DurableFile(staged.stored_in or record.name, staged.size,
                                                  staged.sha256)
                         for staged in staging.files.values()}
        return max(0, sent[0])

    # ------------------------------------------------------------------ streaming

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
                save.staging = self.destination.open_staging(save.name)
            staged = reuse(save.staging, save.path, relative, key[1], None, self._durable)
            if staged is None:
                before = save.sent_bytes

                def progress(count: int) -> None:
                    save.sent_bytes += count
                    self.tracker.add_progress(save.name, count)  # no record yet: the total

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
            self._failed(None, self.destination.describe_error(
                exc, f"sending {save.name}/{relative} early"))
        save.send_seconds += time.monotonic() - started
        return True

    def _stream_stop(self, save: SaveInProgress) -> Optional[str]:
        if self._stop.is_set():
            return "the daemon is stopping"
        if not save.path.exists() and folder_id(self.config.root / save.name) != save.folder:
            return "the save's folder is gone"
        return None

    def _discard(self, save: SaveInProgress) -> None:
        if save.staging is None:
            return
        try:
            save.staging.discard()
        except Exception as exc:
            log.warning("could not discard the staged files of %s: %s", save.name,
                        self.destination.describe_error(exc, "discarding"))
        save.staging = None

    def _should_yield(self, current: UploadRecord) -> Optional[str]:
        """Checked while transfers run: a reason to stop this upload, or None."""
        if self._stop.is_set():
            return "the daemon is stopping"
        if self._wake.is_set() or (
            time.monotonic() - self._last_scan >= self.config.scan_interval_seconds
        ):
            self._wake.clear()
            self._scan()  # newer checkpoints show up in the status while this one goes
        remaining = self._remaining()
        newest = next((r for r in self.tracker.records() if r.state in ("pending", "failed")),
                      None)
        if remaining is None or newest is None or not newest.newer_than(current):
            return None  # nothing newer to give way to: finish this one
        progress = self.tracker.get(current.name) or current
        if not plan.gives_way(
            remaining, near_release_seconds=self.config.near_release_seconds,
            next_upload=self.tracker.next_upload_seconds(),
            current_left=max(0, progress.bytes_total - progress.bytes_done),
            newer=newest.bytes_total, rate=self.tracker.throughput(),
        ):
            return None  # far from the release, or both still end before it, this one first
        return (f"yielded to {newest.name} (step {newest.step}): the release is "
                f"{max(0.0, remaining):.0f} s away")

    def _failed(self, name: Optional[str], message: str) -> None:
        message = printable(message)  # it may name the job's folders: shown and logged
        now = self._clock()
        self.tracker.record_failure(name, message, retry_at=now)
        # Counted here, reset only by an upload that succeeds: a volume that is full or
        # read-only still answers reads, so "a storage call succeeded" would restart the
        # backoff at every attempt (issue 22, weak points).
        self._failures_in_a_row += 1
        failures = self._failures_in_a_row
        delay = min(self.config.backoff_cap_seconds,
                    self.config.backoff_base_seconds * 2 ** min(failures - 1, 30))
        delay *= random.uniform(0.5, 1.0)  # jitter: many hosts must not retry in step
        retry_at = now + delay
        if name is not None:
            self.tracker.update(name, retry_at_unix=retry_at)
        self._storage_retry_at = retry_at
        self.destination.reset()
        # Once per change of the error; the same error again only at debug level.
        level = logging.WARNING if message != self._last_failure else logging.DEBUG
        self._last_failure = message
        log.log(level, "%s; retrying in %.1f s (failure %d in a row)", message, delay, failures)

    def _succeeded(self) -> None:
        if self._failures_in_a_row:
            log.info("uploads work again after %d failure(s) in a row", self._failures_in_a_row)
        self._failures_in_a_row = 0
        self._last_failure = None

    # ------------------------------------------------------------------ local chores

    def _pin(self, folder: Path) -> Optional[Pin]:
        """Pin ``folder`` while it uploads (``jobfiles.pin``: never through a path). An
        upload goes on unpinned when the pin cannot be made: a job's entry of that name
        pins it already, and the daemon's own retention keeps what it has not settled."""
        text = f"{_MARKER_TEXT} pid={os.getpid()} since={self._clock():.0f}\n"
        made, what = pin(folder, text)
        if made is None:
            log.info("not pinning %s while it uploads: %s", printable(folder.name), what)
        return made

    def _unpin(self, made: Pin) -> None:
        problem = unpin(made)
        if problem is not None:
            log.warning("%s", problem)

    def _clear_stale_markers(self) -> None:
        """Markers an earlier (killed) run left: they would pin folders for ever."""
        for listing in list_checkpoints(self.config.root):
            if clear_stale_pin(listing.path, _MARKER_TEXT):
                log.info("removed the stale %s left in %s by an earlier run", MARKER_NAME,
                         printable(str(listing.path)))

    def _keep_local(self) -> None:
        keep = self.config.keep_local
        if keep is None:
            return
        settled = {r.name for r in self.tracker.records() if r.state in ("done", "skipped")}
        try:
            removed = prune(self.config.root, keep,
                            protect=lambda info: info.name not in settled)
        except OSError as exc:
            log.warning("could not prune %s: %s", self.config.root, exc)
            return
        for path in removed:
            log.info("removed local %s: durable in storage, beyond the %d newest", path.name,
                     keep)
