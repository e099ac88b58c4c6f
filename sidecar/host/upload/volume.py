"""A network volume as the destination: ``file:///mnt/share/run-42`` (vePFS, NAS, NFS mounted
on the host). Standard library only: restore from a volume needs no boto3.

The volume is laid out like a local checkpoint root (``<root>/<name>/`` with its files and
``MANIFEST.json``), so ``latest_valid(root)`` reads it and restore copies it back. The
guarantees are those of an upload to S3: each checkpoint is copied into a temporary
folder named like a save's (``.tmp-<name>.<writer>.<token>``), every file fsynced, the
manifest written last, the folder renamed into place and the root fsynced. A half-copied
checkpoint is never visible under its name; a killed copy leaves a ``.tmp-`` folder that
``clean_leftovers`` removes once its writer is gone.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import logging
import os
import shutil
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from sidecar.checkpoint.durable import fsync_fd, rename_durably
from sidecar.checkpoint.folders import LATEST_NAME, latest_valid, list_checkpoints, validate
from sidecar.checkpoint.leftovers import clean_leftovers
from sidecar.checkpoint.manifest import (
    MANIFEST_NAME,
    CheckpointError,
    CheckpointInfo,
    FileEntry,
    Invalid,
    check_files,
    open_listed,
    read_manifest,
)
from sidecar.host.upload.commit_check import DurableFile, StagingDestination, durable_entries
from sidecar.host.upload.follow_place import (
    Private,
    hand_over,
    no_replace,
    open_target,
    place_latest,
)
from sidecar.host.upload.identity import NotTheVolume, VolumeIdentity, unmounted_reason
from sidecar.host.upload.verified_copy import FolderSource, copy_verified
from sidecar.host.upload.volume_stage import (
    Cancelled,
    Throttle,
    VolumeStaging,
    seal_folder,
    staging_folder,
)

__all__ = [
    "COPY_ATTEMPTS",
    "EXIT_FAILED",
    "EXIT_NOTHING",
    "Cancelled",
    "RestoreError",
    "Restored",
    "Throttle",
    "VolumeDestination",
    "check_copy",
    "commit_folder",
    "commit_into",
    "copy_checkpoint",
    "describe_os_error",
    "newest_on_volume",
    "restore_checkpoint",
    "restore_from_volume",
]

log = logging.getLogger("sidecar.host.upload.volume")

_CHUNK = 4 << 20
COPY_ATTEMPTS = 3  # copies of a file that does not match its manifest before giving up


def commit_folder(
    root: Path, name: str, manifest: bytes, fill: Callable[[Path], None],
    before_rename: Callable[[], None] = lambda: None,
) -> Path:
    """Commit a checkpoint folder ``root/<name>`` whose files ``fill(temp)`` writes (and
    checks) into a temporary folder, then :func:`seal_folder`. The same commit as
    ``atomic_checkpoint``, for copies that bring their manifest along: a volume upload
    and both restores. ``before_rename`` may raise to give up at the last moment (a
    volume proves it is still the volume it was)."""
    temp = staging_folder(root, name)
    temp.mkdir()
    try:
        fill(temp)
        return seal_folder(root, name, temp, manifest, before_rename)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise


def copy_checkpoint(
    info: CheckpointInfo,
    manifest: bytes,
    target_root: Path,
    *,
    on_progress: Callable[[int], None] = lambda count: None,
    should_stop: Callable[[], Optional[str]] = lambda: None,
    before_manifest: Callable[[], None] = lambda: None,
    before_rename: Callable[[], None] = lambda: None,
    check: Callable[[Path], None] = lambda folder: None,
    max_bandwidth: Optional[int] = None,
    verify_checksums: bool = True,
) -> Path:
    """Copy the checkpoint ``info`` (a complete folder) into ``target_root/<name>`` with its
    own ``manifest`` bytes (see :func:`commit_folder`). Every file is opened without
    following links (``open_listed``) and checked against the manifest while it is read:
    its size, and its sha256 when the manifest has one and ``verify_checksums``; a file
    that does not match is copied again, up to ``COPY_ATTEMPTS`` times, then
    :class:`Invalid` is raised and nothing is committed (issue 22, item 4). ``check(temp)``
    runs on the copy before it is committed. Returns the new folder."""
    throttle = Throttle(max_bandwidth)

    def copy_once(entry: FileEntry, target: Path) -> Optional[str]:
        """Copy one file; the reason it does not match its manifest, or None."""
        hasher = hashlib.sha256() if verify_checksums and entry.sha256 else None
        count = 0
        with open(open_listed(info.path, entry.path), "rb", buffering=0) as reader, \
                open(target, "xb") as writer:
            while True:
                reason = should_stop()
                if reason:
                    raise Cancelled(reason)
                # Never more than one byte past the manifest's size: enough to see a
                # file that grew, without copying all of a file still being appended to.
                chunk = reader.read(min(_CHUNK, entry.size + 1 - count))
                if not chunk:
                    break
                writer.write(chunk)
                count += len(chunk)
                if hasher is not None:
                    hasher.update(chunk)
                on_progress(len(chunk))
                throttle(len(chunk))
                if count > entry.size:
                    break
        if count > entry.size:
            return f"more than the {entry.size} bytes the manifest says"
        if count < entry.size:
            return f"{count} bytes, the manifest says {entry.size}"
        if hasher is not None and hasher.hexdigest() != entry.sha256:
            return "its sha256 differs"
        return None

    def fill(temp: Path) -> None:
        for entry in info.files:
            target = temp / entry.path
            target.parent.mkdir(parents=True, exist_ok=True)
            for attempt in range(1, COPY_ATTEMPTS + 1):
                mismatch = copy_once(entry, target)
                if mismatch is None:
                    break
                on_progress(-target.stat().st_size)  # the bytes are sent again
                target.unlink()
                log.info("the copy of %s does not match its manifest (%s); attempt %d of %d",
                         info.path / entry.path, mismatch, attempt, COPY_ATTEMPTS)
            else:
                raise Invalid(f"file {entry.path} does not match its manifest in "
                              f"{COPY_ATTEMPTS} copies ({mismatch}): changed while it was "
                              "copied?")
        check(temp)
        before_manifest()

    return commit_folder(target_root, info.name, manifest, fill, before_rename)


def check_copy(info: CheckpointInfo, verify_checksums: bool) -> Callable[[Path], None]:
    """A ``check`` for a copy of ``info``: sizes (and sha256) against its manifest."""
    def check(folder: Path) -> None:
        copy = CheckpointInfo(folder, info.step, info.created_at, info.total_bytes,
                              info.metadata, info.files)
        check_files(copy, verify_checksums=verify_checksums)
    return check


def point_latest(private: Private, root_fd: int, root: Path, name: str, uid: int,
                 gid: int) -> None:
    """``root/latest`` names ``name`` when it is the newest valid checkpoint there: made in
    ``private`` and renamed in relative to ``root_fd``, over the pointer found only while
    it is still that one (``follow_place.place_latest``)."""
    newest = latest_valid(root, clean=False)
    if newest is None or newest.name != name:
        return
    try:
        found: Optional[int] = os.lstat(LATEST_NAME, dir_fd=root_fd).st_ino
    except FileNotFoundError:
        found = None
    place_latest(private, root_fd, name, uid, gid, found)


def commit_into(root: Path, name: str, manifest: bytes,
                fill: Callable[[Path], None]) -> CheckpointInfo:
    """Commit ``root/<name>`` in a job's folder (hostile: ARCHITECTURE.md, "Trust
    boundary") and point ``latest`` at it. The folder is opened once
    (``follow_place.open_target``); the copy is built by :func:`commit_folder` in a
    private folder reached only through its fd (``follow_place.Private``), checked,
    handed to the folder's owner, then renamed in relative to the folder's fd, never over
    an entry made meanwhile. Returns the validated checkpoint. Raises :class:`Invalid`
    from ``fill``, else :class:`RestoreError` with one line."""
    try:
        root_fd = open_target(root)
    except OSError as exc:
        raise RestoreError(describe_os_error(exc, "opening the folder", root)) from None
    try:
        owner = os.fstat(root_fd)
        private = Private(root_fd)
        try:
            built = commit_folder(private.path, name, manifest, fill)
            info = validate(built)
            hand_over(built, owner.st_uid, owner.st_gid, file_mode=0o644)
            rename_durably(name, name, src_dir_fd=private.fd, dst_dir_fd=root_fd,
                           rename=no_replace)
            point_latest(private, root_fd, root, name, owner.st_uid, owner.st_gid)
        finally:
            private.discard()
    except FileExistsError:
        raise RestoreError(f"{root / name} appeared while it was restored (another "
                           "process writes there): left as it is") from None
    except CheckpointError as exc:  # pragma: no cover - fill checked every file
        raise RestoreError(str(exc)) from None
    except OSError as exc:
        raise RestoreError(describe_os_error(exc, f"restoring {name}", root)) from None
    finally:
        os.close(root_fd)
    return dataclasses.replace(info, path=root / name)


def newest_on_volume(root: Path, step: Optional[int] = None) -> Optional[CheckpointInfo]:
    """The newest complete checkpoint under ``root`` (or the one at ``step``)."""
    complete: Iterable[CheckpointInfo] = (
        listing.info for listing in list_checkpoints(root) if listing.info is not None)
    for info in complete:  # newest first
        if step is None or info.step == step:
            return info
    return None


def describe_os_error(exc: BaseException, doing: str, where: Path) -> str:
    if isinstance(exc, OSError):
        reason = {errno.ENOSPC: "the volume is full", errno.EROFS: "the volume is read-only",
                  errno.EACCES: "permission denied", errno.ENOENT: "not found (not mounted?)",
                  }.get(exc.errno or 0, exc.strerror or str(exc))
        return f"{doing} in {where}: {reason}"
    return f"{doing} in {where}: {type(exc).__name__}: {exc}"


@dataclass
class VolumeDestination(StagingDestination):
    """The uploader's destination on a mounted volume (see the module's docstring). Before
    a copy counts as durable, the folder proves it is still the volume it was
    (:mod:`sidecar.host.upload.identity`)."""

    root: Path
    max_bandwidth: Optional[int] = None
    fstab: Path = Path("/etc/fstab")

    def __post_init__(self) -> None:
        self.identity = VolumeIdentity(self.root, fstab=self.fstab)

    @property
    def url(self) -> str:
        return self.root.as_uri()

    @property
    def endpoint(self) -> Optional[str]:
        return None

    @property
    def where(self) -> str:
        return f"volume {self.root}"

    def prepare(self, started_at_unix: float) -> None:
        """The volume must be there: creating the folder would write to the host's own
        disk when the volume is not mounted, and that dies with the machine."""
        if not self.root.is_dir():
            raise FileNotFoundError(errno.ENOENT, "no such folder", str(self.root))
        self.identity.start()
        clean_leftovers(self.root)  # copies a killed daemon left half done

    def remote_manifest(self, name: str) -> Optional[bytes]:
        try:
            raw = (self.root / name / MANIFEST_NAME).read_bytes()
        except FileNotFoundError:
            return None
        self.identity.confirm()  # "already complete there" counts as durable too
        return raw

    def open_staging(self, name: str) -> VolumeStaging:
        """A hidden folder for ``name``'s files before its manifest lands (streaming)."""
        self.identity.confirm()  # no byte onto the host's disk in the volume's place
        return VolumeStaging(self.root, name, max_bandwidth=self.max_bandwidth,
                             before_rename=self.identity.confirm)

    def durable_files(self, name: str) -> dict[str, DurableFile]:
        """The files of the durable checkpoint ``name`` whose sha256 its manifest records."""
        try:
            info = read_manifest(self.root / name)
        except Invalid:
            return {}
        return durable_entries(name, info)

    def make_self_contained(self, name: str, should_stop: Callable[[], Optional[str]]) -> int:
        """Nothing to do: an unchanged file is a hard link, in its own folder already."""
        return 0

    def probe(self, amount: int, should_stop: Callable[[], Optional[str]]) -> None:
        """``amount`` bytes written (at the volume's cap) and fsynced into a hidden staging
        folder, then removed (``probe.LinkProbe``)."""
        self.identity.confirm()  # no byte onto the host's disk in the volume's place
        folder = staging_folder(self.root, "probe")
        throttle = Throttle(self.max_bandwidth)
        chunk = os.urandom(min(amount, 4 << 20))
        try:
            folder.mkdir()
            handle = os.open(folder / "probe", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                left = amount
                while left > 0:
                    reason = should_stop()
                    if reason is not None:
                        raise Cancelled(reason)
                    piece = chunk[:left]
                    throttle(len(piece))
                    os.write(handle, piece)
                    left -= len(piece)
                fsync_fd(handle)
            finally:
                os.close(handle)
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def describe_error(self, exc: BaseException, doing: str) -> str:
        if isinstance(exc, NotTheVolume):
            return str(exc)
        if isinstance(exc, Invalid):
            return f"{doing}: {exc}"
        return describe_os_error(exc, doing, self.root)

    def reset(self) -> None:
        pass


# -- restore: from a volume here, from S3 in sidecar.host.upload.restore -------------------

EXIT_FAILED = 1
EXIT_NOTHING = 3  # no complete checkpoint: a fresh start, not an error, for a start script


class RestoreError(Exception):
    """One line for the user; ``exit_code`` for the command."""

    def __init__(self, message: str, exit_code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@dataclass(frozen=True)
class Restored:
    info: CheckpointInfo  # the local, validated checkpoint
    source: str  # where it came from
    seconds: float
    already_present: bool


def already_there(target: Path, manifest: bytes, source: str, started: float) -> Restored:
    """``target`` exists: fine when it is the same checkpoint, else a clear error."""
    try:
        same = (target / MANIFEST_NAME).read_bytes() == manifest
        info = validate(target) if same else None
    except (OSError, CheckpointError):
        info = None
    if info is None:
        raise RestoreError(f"{target} already exists and is not the same checkpoint as "
                           f"{source}: move it away or restore into another folder")
    return Restored(info, source, time.monotonic() - started, already_present=True)


def restore_from_volume(
    volume: Path, root: Path, *, step: Optional[int] = None, verify_checksums: bool = True
) -> Restored:
    """Copy the newest valid checkpoint on ``volume`` (or the one at ``step``) into
    ``root``, committed as a save is, with the same manifest; ``latest_valid(root)``
    then finds it. A checkpoint on the volume that does not match its manifest (a
    missing or short file, a link, a sha256 that differs) is skipped with a warning
    naming it and why, and the next older one is tried. Raises :class:`RestoreError`
    with one line."""
    started = time.monotonic()
    if not volume.is_dir():
        raise RestoreError(f"{volume}: no such folder (is the volume mounted?)")
    try:
        listings = [listing for listing in list_checkpoints(volume)
                    if step is None or listing.step == step]
    except OSError as exc:
        raise RestoreError(describe_os_error(exc, "listing", volume)) from None
    damaged = 0  # with a manifest, but not matching it: a failure, not a fresh start
    for listing in listings:  # newest first
        if listing.info is None:
            log.warning("skipping %s: %s", listing.path, listing.reason)
            damaged += os.path.lexists(listing.path / MANIFEST_NAME)
            continue
        try:
            return restore_checkpoint(listing.info, root, verify_checksums=verify_checksums,
                                      started=started)
        except Invalid as exc:
            log.warning("skipping %s: %s", listing.path, exc)
            damaged += 1
    which = "complete checkpoint" if step is None else f"complete checkpoint at step {step}"
    if damaged:
        raise RestoreError(f"no valid checkpoint in {volume}: {damaged} skipped because "
                           "they do not match their manifests (see above)")
    unmounted = unmounted_reason(volume)
    if unmounted is not None:  # the empty place of a volume, not an empty volume
        raise RestoreError(f"no {which} in {volume}: is the volume mounted? ({unmounted})")
    raise RestoreError(f"no {which} in {volume}", EXIT_NOTHING)


def restore_checkpoint(found: CheckpointInfo, root: Path, *, verify_checksums: bool = True,
                       started: Optional[float] = None) -> Restored:
    """Copy the complete checkpoint ``found`` (a folder on the volume) into ``root`` and
    commit it there, every file checked while it is copied, files and ranges in parallel
    (``verified_copy``). Raises :class:`Invalid` when it does not match its manifest
    (nothing is left behind), :class:`RestoreError` for any other failure."""
    started = time.monotonic() if started is None else started
    source = str(found.path)
    try:
        manifest = (found.path / MANIFEST_NAME).read_bytes()
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RestoreError(describe_os_error(exc, f"reading {source}", root)) from None
    target = root / found.name
    if os.path.lexists(target):
        return already_there(target, manifest, source, started)
    clean_leftovers(root)

    def fill(temp: Path) -> None:  # checked while copying: a mismatch is never committed
        copy_verified(FolderSource(found.path), found.files, temp,
                      verify_checksums=verify_checksums)

    info = commit_into(root, found.name, manifest, fill)
    return Restored(info, source, time.monotonic() - started, already_present=False)
