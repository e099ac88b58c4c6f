"""The daemon's upload thread: each complete local checkpoint to storage, newest first.

A cycle: scan the checkpoint root (``list_checkpoints``: manifest present, sizes match),
pick the newest checkpoint not yet durable, commit it at the destination (the files
sent while it was saved checked, the others sent: ``commit_check.complete``, manifest
last), repeat; with nothing to commit, one piece of idle work (``idle``: send one
finished file of a save in progress, else copy into a durable S3 checkpoint the unchanged
files it still reads from an older folder, else probe the link when due); sleep until
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

import hashlib
import logging
import os
import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from sidecar.checkpoint.folders import CheckpointInfo, list_checkpoints, prune
from sidecar.checkpoint.manifest import MANIFEST_NAME, UPLOADING_MARKER, Invalid
from sidecar.host.logs import printable
from sidecar.host.upload import plan
from sidecar.host.upload.commit_check import DurableFile
from sidecar.host.upload.destination import Destination
from sidecar.host.upload.idle import IdleWork
from sidecar.host.upload.jobfiles import Pin, Refused, clear_stale_pin, pin, read_job_file, unpin
from sidecar.host.upload.location import S3Location
from sidecar.host.upload.plan import (
    DEFAULT_UPLOAD_NEAR_RELEASE_SECONDS,
    DEFAULT_UPLOAD_SCAN_INTERVAL_SECONDS,
)
from sidecar.host.upload.probe import LinkProbe
from sidecar.host.upload.status import UploadRecord, UploadTracker
from sidecar.host.upload.storage_config import StorageConfig
from sidecar.host.upload.stream import DEFAULT_SETTLE_SECONDS, SaveInProgress
from sidecar.host.upload.volume import Cancelled
from sidecar.host.upload.watch import FolderWatch

__all__ = ["MARKER_NAME", "Destination", "Uploader", "UploaderConfig"]

log = logging.getLogger("sidecar.host.upload")

MARKER_NAME = UPLOADING_MARKER  # pins the folder against retention while it uploads
_MARKER_TEXT = "esi-sidecar uploader"  # first words of markers this uploader writes
# Note on a record whose folder vanished (pruned, or moved aside by a re-save that a kill
# interrupted: if it comes back, it is considered again).
_GONE = "the local checkpoint is gone"
_INVALID = "not valid: "  # then why: considered again when it is valid again
_REFUSED = "not durable: "  # then which job file was refused: again once saved again


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


def manifest_digest(raw: bytes) -> str:
    """What tells one commit of a checkpoint from another: its manifest's sha256."""
    return hashlib.sha256(raw).hexdigest()


def backoff_seconds(failures: int, base: float, cap: float) -> float:
    """The wait before the next try after ``failures`` in a row: doubling from ``base`` up
    to ``cap``, then jittered to half of that or more (many hosts must not retry in step)."""
    return min(cap, base * 2 ** min(failures - 1, 30)) * random.uniform(0.5, 1.0)


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
        client_factory: Optional[Callable[[StorageConfig], Any]] = None,
        clock: Callable[[], float] = time.time,
        destination: Optional[Destination] = None,
    ) -> None:
        self.config = config
        # S3 / TOS from the config unless another destination (a mounted volume) is given.
        if destination is None:
            if config.location is None:
                raise ValueError("an S3 location or a destination is needed")
            # Here, not at the top: a volume's uploader never loads boto3 (issue 39, item 9).
            from sidecar.host.upload.storage import make_client
            from sidecar.host.upload.transfer import S3Destination

            destination = S3Destination(config.storage, config.location,
                                        client_factory or make_client)
        self.destination: Destination = destination
        self.tracker = tracker or UploadTracker(
            source=str(config.root), destination=self.destination.url,
            endpoint=self.destination.endpoint, max_bandwidth=config.storage.max_bandwidth,
            clock=clock,
        )
        self._remaining = remaining_seconds
        self._clock = clock
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._watch = FolderWatch(config.root, self.wake)
        probe = LinkProbe(self.destination, self.tracker, remaining_seconds=remaining_seconds,
                          near_release_seconds=config.near_release_seconds,
                          ) if config.probe else None
        # Streaming, references, the probe: done while no commit waits (``idle``).
        self._idle = IdleWork(
            config.root, self.destination, self.tracker, stop=self._stop, wake=self._wake,
            watch=self._watch, failed=self._failed, clock=clock,
            scan_interval_seconds=config.scan_interval_seconds,
            settle_seconds=config.settle_seconds, stream=config.stream, probe=probe)
        self._started_at = clock()
        self._prepared = False
        self._storage_retry_at = 0.0
        self._failures_in_a_row = 0
        self._last_failure: Optional[str] = None
        self._refused: dict[str, str] = {}  # committed checkpoints no longer valid: why
        self._last_scan = 0.0  # time.monotonic() of the last scan
        self._last_scan_at: Optional[float] = None  # the same on self._clock, once done

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("the uploader is already started")
        self._started_at = self._clock()
        clear_stale_markers(self.config.root)
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
        self._idle.close()  # staged files of saves never committed: not kept

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
        self._idle.scan_saves()
        record = self._next()
        if record is None:
            return self._idle.run()
        self._attempt(record)
        return 0.0

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
        save = self._idle.take(folder, record.name)
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
                    self._idle.discard(save)
                self.tracker.record_done(record.name, duration=None,
                                         note="already complete in storage")
                log.info("%s is already complete in %s", record.name, self.destination.url)
                self._idle.made_durable(record.name,
                                        self.destination.durable_files(record.name))
                self._succeeded()
            else:
                sent = self._upload(record, info, raw, folder, inode, save)
                duration = time.monotonic() - started
                self.tracker.record_done(
                    record.name, duration=duration, note=None, sent_after_save=sent,
                    sent=streamed + sent,
                    send_seconds=(save.send_seconds if save else 0.0) + duration)
                self._idle.measured()
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
            before_manifest=unchanged, staging=staging, durable=self._idle.durable,
        )
        self._idle.made_durable(record.name, {
            staged.path: DurableFile(staged.stored_in or record.name, staged.size, staged.sha256)
            for staged in staging.files.values()})
        return max(0, sent[0])

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
        delay = backoff_seconds(failures, self.config.backoff_base_seconds,
                                self.config.backoff_cap_seconds)
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


def clear_stale_markers(root: Path) -> None:
    """The pins an earlier (killed) run left in ``root``'s checkpoints: they would pin
    folders for ever."""
    for listing in list_checkpoints(root):
        if clear_stale_pin(listing.path, _MARKER_TEXT):
            log.info("removed the stale %s left in %s by an earlier run", MARKER_NAME,
                     printable(str(listing.path)))
