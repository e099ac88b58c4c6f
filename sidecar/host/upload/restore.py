"""``esi-sidecar restore``: the newest complete remote checkpoint onto a fresh machine.

Only a remote folder whose ``MANIFEST.json`` exists is a checkpoint (the uploader writes
it last). Its files (an unchanged one from the older folder its references name,
``s3_refs``) are fetched with parallel ranged GETs straight into a hidden temporary
folder in the target root and checked against the manifest in the same pass (sizes
always, sha256 when the save recorded it; ``verified_copy``, ``s3_source``), fsynced, the
remote manifest written last, and the folder renamed into place: the same commit as
``atomic_checkpoint``, made through the target folder's fd (``volume.commit_into``: the
folder may be a job's, hostile input), so ``latest_valid(root)`` finds it and nothing
appears under the checkpoint's name before it is complete. A checkpoint whose files do
not match its manifest is skipped with a warning and the next older one is taken, as
from a volume.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from sidecar.checkpoint.folders import clean_leftovers
from sidecar.checkpoint.manifest import CheckpointInfo, Invalid
from sidecar.host.upload.location import S3Location
from sidecar.host.upload.s3_refs import read_references, source_key
from sidecar.host.upload.s3_source import S3Source
from sidecar.host.upload.storage import describe_error, make_client
from sidecar.host.upload.storage_config import StorageConfig
from sidecar.host.upload.transfer import list_remote_names, parse_manifest, read_remote_manifest
from sidecar.host.upload.verified_copy import copy_verified
from sidecar.host.upload.volume import (
    EXIT_NOTHING,
    Restored,
    RestoreError,
    already_there,
    commit_into,
    describe_os_error,
)

__all__ = ["RemoteCheckpoint", "find_complete", "restore", "restore_checkpoint", "restore_named"]

log = logging.getLogger("sidecar.host.upload.restore")

_TRAILING_NUMBER = re.compile(r"(\d+)$")


@dataclass(frozen=True)
class RemoteCheckpoint:
    name: str
    manifest: bytes
    info: CheckpointInfo  # path is the remote folder's name; files as listed


def _name_step(name: str) -> int:
    match = _TRAILING_NUMBER.search(name)
    return int(match.group(1)) if match else -1


def find_complete(
    client: Any, location: S3Location, step: Optional[int] = None,
    skip: Collection[str] = (),
) -> tuple[Optional[RemoteCheckpoint], int]:
    """The newest complete remote checkpoint (or the one at ``step``) and the number of
    folders skipped because they have no manifest (partial uploads). Folders named in
    ``skip`` (found damaged already) are not read.

    Manifests are read in the order the folder names suggest (``step_00000300`` before
    ``step_00000200``), stopping once no unread name can hold a newer step.
    """
    names = sorted(list_remote_names(client, location), key=lambda n: (_name_step(n), n),
                   reverse=True)
    best: Optional[RemoteCheckpoint] = None
    incomplete = 0
    for name in names:
        if name in skip:
            continue
        hinted = _name_step(name)
        if best is not None and step is None and 0 <= hinted < best.info.step:
            break  # every name left says an older step (names without a number come last)
        raw = read_remote_manifest(client, location, name)
        if raw is None:
            incomplete += 1
            log.info("skipping %s%s: no manifest (an unfinished upload)", location.listing_prefix,
                     name)
            continue
        try:
            info = parse_manifest(raw, Path(name))
        except Invalid as exc:
            log.warning("skipping %s%s: %s", location.listing_prefix, name, exc)
            continue
        if step is not None and info.step != step:
            continue
        candidate = RemoteCheckpoint(name, raw, info)
        if best is None or (info.step, info.created_at) > (best.info.step, best.info.created_at):
            best = candidate
        if step is not None:
            break
    return best, incomplete


def restore(
    storage: StorageConfig,
    location: S3Location,
    root: Path,
    *,
    step: Optional[int] = None,
    verify_checksums: bool = True,
    client: Optional[Any] = None,
    on_progress: Callable[[int], None] = lambda count: None,
) -> Restored:
    """Download and commit the newest complete checkpoint under ``location`` (or the one
    at ``step``) into ``root``; one that does not match its manifest is skipped for the
    next older one. Raises :class:`RestoreError` (one clear line) on any failure."""
    started = time.monotonic()
    client = client if client is not None else make_client(storage)
    damaged: dict[str, str] = {}  # name: why, newest first
    while True:
        try:
            found, incomplete = find_complete(client, location, step, skip=damaged)
        except Exception as exc:
            raise RestoreError(describe_error(exc, storage, f"listing {location}")) from None
        if found is None:
            raise _nothing_valid(location, step, incomplete, damaged)
        try:
            return restore_checkpoint(client, storage, location, found, root,
                                      verify_checksums=verify_checksums,
                                      on_progress=on_progress, started=started)
        except Invalid as exc:
            log.warning("skipping %s%s: %s", location.listing_prefix, found.name, exc)
            damaged[found.name] = str(exc)


def _nothing_valid(location: S3Location, step: Optional[int], incomplete: int,
                   damaged: dict[str, str]) -> RestoreError:
    if damaged:  # with a manifest, but not matching it: a failure, not a fresh start
        name, why = next(iter(damaged.items()))
        return RestoreError(f"no valid checkpoint under {location}: {len(damaged)} skipped "
                            f"because they do not match their manifests (the newest, {name}: "
                            f"{why})")
    which = "complete checkpoint" if step is None else f"complete checkpoint at step {step}"
    extra = f" ({incomplete} folder(s) without a manifest: unfinished uploads)" \
        if incomplete else ""
    return RestoreError(f"no {which} under {location}{extra}", EXIT_NOTHING)


def restore_named(
    storage: StorageConfig,
    location: S3Location,
    name: str,
    root: Path,
    *,
    verify_checksums: bool = True,
    client: Optional[Any] = None,
) -> Restored:
    """Download and commit the complete checkpoint ``name`` under ``location`` into
    ``root`` (no fallback: it is this one or an error). Raises :class:`RestoreError`."""
    started = time.monotonic()
    client = client if client is not None else make_client(storage)
    source = location.url.rstrip("/") + "/" + name + "/"
    try:
        raw = read_remote_manifest(client, location, name)
        if raw is None:
            raise RestoreError(f"{source} is not a complete checkpoint (no manifest)",
                               EXIT_NOTHING)
        found = RemoteCheckpoint(name, raw, parse_manifest(raw, Path(name)))
        return restore_checkpoint(client, storage, location, found, root,
                                  verify_checksums=verify_checksums, started=started)
    except Invalid as exc:
        raise RestoreError(f"{source}: {exc}") from None
    except RestoreError:
        raise
    except Exception as exc:
        raise RestoreError(describe_error(exc, storage, f"reading {source}")) from None


def restore_checkpoint(
    client: Any,
    storage: StorageConfig,
    location: S3Location,
    found: RemoteCheckpoint,
    root: Path,
    *,
    verify_checksums: bool = True,
    on_progress: Callable[[int], None] = lambda count: None,
    started: Optional[float] = None,
) -> Restored:
    """Download the complete remote checkpoint ``found`` into ``root`` and commit it:
    ``storage.concurrency`` ranged GETs at once, every byte written into place and hashed
    as it arrives. Raises :class:`Invalid` when a file does not match the manifest (a
    missing, short or long object, a sha256 that differs; nothing is left behind), else
    :class:`RestoreError`."""
    started = time.monotonic() if started is None else started
    source = location.url.rstrip("/") + "/" + found.name + "/"
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RestoreError(describe_os_error(exc, "making the folder", root)) from None
    target = root / found.name
    if os.path.lexists(target):
        return already_there(target, found.manifest, source, started)
    clean_leftovers(root)
    try:
        references = read_references(client, location, found.name)
    except Invalid as exc:
        raise RestoreError(f"{source}: {exc}") from None
    except Exception as exc:
        raise RestoreError(describe_error(exc, storage, f"reading {source}")) from None
    keys = {entry.path: source_key(location, found.name, entry.path, references)
            for entry in found.info.files}
    files = S3Source(client, location.bucket, keys, storage.max_bandwidth)

    def fill(temp: Path) -> None:
        try:
            copy_verified(files, found.info.files, temp, verify_checksums=verify_checksums,
                          workers=storage.concurrency, on_progress=on_progress)
        except Invalid as exc:
            raise Invalid(f"the downloaded checkpoint does not match its manifest: "
                          f"{exc}") from None
        except Exception as exc:
            raise RestoreError(describe_error(exc, storage, f"downloading {source}")) from None

    info = commit_into(root, found.name, found.manifest, fill)
    return Restored(info, source, time.monotonic() - started, already_present=False)
