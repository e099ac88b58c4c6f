"""The commit check: which files sent before the manifest landed still match it, and the
loop that sends the others again (or copies them from a durable checkpoint) before the
destination makes the checkpoint visible (issue 23, items 1 and 2).

A file sent early is kept only when all of these hold: it was read whole without changing
(its inode, size, mtime and ctime the same before and after the read), the local file is
still that file now (the same four numbers), its size is the manifest's, and the sha256
computed while it was read is the manifest's when the manifest records one. Anything else
is sent again; a file that still does not match after ``COPY_ATTEMPTS`` reads stops the
commit with :class:`Invalid`, and nothing becomes visible. Both destinations (the volume's
hidden folder, S3's multipart uploads completed only at commit) run this same check.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Callable, Optional, Protocol

from sidecar.checkpoint.manifest import CheckpointInfo, FileEntry, Invalid
from sidecar.host.upload.jobfiles import open_job_file

__all__ = [
    "COPY_ATTEMPTS",
    "DurableFile",
    "StagedFile",
    "Staging",
    "StagingDestination",
    "StatKey",
    "complete",
    "durable_entries",
    "hash_file",
    "mismatch",
    "stat_key",
]

log = logging.getLogger("sidecar.host.upload.commit")

COPY_ATTEMPTS = 3  # reads of a file that does not match its manifest before giving up
_CHUNK = 8 << 20

StatKey = tuple[int, int, int, int]  # inode, size, mtime_ns, ctime_ns


def stat_key(result: os.stat_result) -> StatKey:
    return (result.st_ino, result.st_size, result.st_mtime_ns, result.st_ctime_ns)


def current_key(folder: Path, relative: str) -> Optional[StatKey]:
    """The local file's key now (``jobfiles``: no link followed), or None when it is not
    there or may not be read."""
    try:
        handle = open_job_file(folder, relative)
    except (Invalid, OSError):
        return None
    try:
        return stat_key(os.fstat(handle))
    finally:
        os.close(handle)


@dataclass(frozen=True)
class StagedFile:
    """A file present at the destination's staging place (sent, or copied server-side)."""

    path: str
    size: int
    sha256: str
    key: StatKey  # the local file's key while it was read
    stored_in: Optional[str] = None  # the folder that keeps its bytes, when not its own


@dataclass(frozen=True)
class DurableFile:
    """A file of a checkpoint durable at the destination: what an unchanged file reuses."""

    checkpoint: str  # the folder that holds its bytes (on S3, maybe not its own: s3_refs)
    size: int
    sha256: str


def hash_file(handle: int) -> tuple[str, StatKey, StatKey]:
    """sha256 of an open file, with its key before and after the read."""
    before = stat_key(os.fstat(handle))
    hasher = hashlib.sha256()
    os.lseek(handle, 0, os.SEEK_SET)
    while True:
        chunk = os.read(handle, _CHUNK)
        if not chunk:
            break
        hasher.update(chunk)
    return hasher.hexdigest(), before, stat_key(os.fstat(handle))


def mismatch(entry: FileEntry, staged: Optional[StagedFile],
             now: Optional[StatKey]) -> Optional[str]:
    """Why the staged copy of ``entry`` cannot be committed, or None when it can."""
    if staged is None:
        return "not sent yet"
    if now is None:
        return "the local file is gone"
    if now != staged.key:
        return "changed after it was sent"
    if staged.size != entry.size:
        return f"{staged.size} bytes sent, the manifest says {entry.size}"
    if entry.sha256 is not None and staged.sha256 != entry.sha256:
        return "its sha256 differs from the manifest's"
    return None


class Staging(Protocol):
    """One checkpoint's files at the destination before it is visible (see the module)."""

    files: dict[str, StagedFile]

    def send(self, folder: Path, relative: str, *, on_progress: Callable[[int], None],
             should_stop: Callable[[], Optional[str]]) -> Optional[StagedFile]:
        """Send the local file; None when it changed while it was read (nothing kept)."""
        ...

    def copy(self, relative: str, durable: DurableFile, key: StatKey) -> Optional[StagedFile]:
        """Make the file present from a durable checkpoint's equal file, no bytes sent;
        None when the server-side copy (hard link, CopyObject) failed."""
        ...

    def drop(self, relative: str) -> None: ...

    def finish(self, info: CheckpointInfo, manifest: bytes) -> None:
        """Make the checkpoint visible: the staged files, then the manifest last."""
        ...

    def discard(self) -> None:
        """Remove everything staged: nothing of it ever becomes visible."""
        ...


def reuse(staging: Staging, folder: Path, relative: str, size: int, known_sha256: Optional[str],
          durable: Mapping[str, DurableFile]) -> Optional[StagedFile]:
    """Make ``relative`` present from an equal durable file without sending it, when one
    has its path and size and the same sha256: ``known_sha256`` (the manifest's) or, when
    the manifest records none, the sha256 of one local read (only for a file whose size
    equals a durable one's). None: send the bytes."""
    candidate = durable.get(relative)
    if candidate is None or candidate.size != size:
        return None
    try:
        handle = open_job_file(folder, relative)
    except (Invalid, OSError):
        return None
    try:
        if known_sha256 is None:
            digest, before, after = hash_file(handle)
            if before != after:
                return None
        else:
            digest, after = known_sha256, stat_key(os.fstat(handle))
    finally:
        os.close(handle)
    if digest != candidate.sha256 or after[1] != size:
        return None
    staged = staging.copy(relative, candidate, after)
    if staged is None:
        log.info("the server-side copy of %s from %s failed; sending its bytes", relative,
                 candidate.checkpoint)
    return staged


def complete(staging: Staging, info: CheckpointInfo, manifest: bytes, *,
             durable: Mapping[str, DurableFile], on_progress: Callable[[int], None],
             should_stop: Callable[[], Optional[str]],
             before_manifest: Callable[[], None]) -> None:
    """Bring ``staging`` in line with ``info``'s manifest, then commit it (``finish``).

    Files not listed are dropped; each listed file whose staged copy fails the check
    (:func:`mismatch`) is copied from an equal durable file or sent again, up to
    ``COPY_ATTEMPTS`` times; a file that still does not match raises :class:`Invalid`."""
    listed = {entry.path for entry in info.files}
    for relative in [path for path in staging.files if path not in listed]:
        staging.drop(relative)
    for entry in info.files:
        reason = mismatch(entry, staging.files.get(entry.path),
                          current_key(info.path, entry.path))
        attempt = 0
        while reason is not None:
            if attempt >= COPY_ATTEMPTS:
                raise Invalid(f"file {entry.path} does not match its manifest in "
                              f"{COPY_ATTEMPTS} reads ({reason}): changed after the save?")
            if attempt or entry.path in staging.files:
                log.info("%s/%s goes again: %s", info.name, entry.path, reason)
            attempt += 1
            staging.drop(entry.path)
            staged = reuse(staging, info.path, entry.path, entry.size, entry.sha256, durable)
            if staged is None:
                staged = staging.send(info.path, entry.path, on_progress=on_progress,
                                      should_stop=should_stop)
            reason = mismatch(entry, staged, current_key(info.path, entry.path))
    before_manifest()
    staging.finish(info, manifest)


def durable_entries(name: str, info: CheckpointInfo,
                    references: Mapping[str, str] = MappingProxyType({}),
                    ) -> dict[str, DurableFile]:
    """The files of the durable checkpoint ``name`` (its manifest read as ``info``) whose
    sha256 the manifest records: those an unchanged file may reuse, each where its bytes
    are (``references``: a file kept in an older folder, ``s3_refs``)."""
    return {entry.path: DurableFile(references.get(entry.path, name), entry.size, entry.sha256)
            for entry in info.files if entry.sha256}


class StagingDestination:
    """The commit both destinations share: ``upload`` through the :class:`Staging` their
    ``open_staging`` gives (the volume's hidden folder, S3's multipart uploads)."""

    def open_staging(self, name: str) -> Staging:
        raise NotImplementedError

    def upload(
        self,
        info: CheckpointInfo,
        manifest: bytes,
        *,
        on_progress: Callable[[int], None],
        should_stop: Callable[[], Optional[str]],
        before_manifest: Callable[[], None],
        staging: Optional[Staging] = None,
        durable: Mapping[str, DurableFile] = MappingProxyType({}),
    ) -> None:
        """Commit ``info``: the files ``staging`` holds already (sent while the save wrote
        them) are checked against the manifest, the others sent or taken from a durable
        checkpoint (linked on the volume, copied server-side on S3), the staging finished
        (on S3: completed and checked with HeadObject) and the manifest written last
        (:func:`complete`). On any failure everything staged is discarded."""
        staged = staging if staging is not None else self.open_staging(info.name)
        try:
            complete(staged, info, manifest, durable=durable, on_progress=on_progress,
                     should_stop=should_stop, before_manifest=before_manifest)
        except BaseException:
            staged.discard()
            raise
