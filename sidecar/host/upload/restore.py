"""``esi-sidecar restore``: the newest complete remote checkpoint onto a fresh machine.

Only a remote folder whose ``MANIFEST.json`` exists is a checkpoint (the uploader writes
it last). Its files (an unchanged one from the older folder its references name,
``s3_refs``) are downloaded into a hidden temporary folder in the target root,
checked against the manifest (sizes always, sha256 when the save recorded it), fsynced,
the remote manifest written last, and the folder renamed into place: the same commit as
``atomic_checkpoint``, so ``latest_valid(root)`` finds it and a killed restore leaves only
a leftover that the next save or resume removes.
"""

from __future__ import annotations

import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from sidecar.checkpoint.folders import CheckpointError, clean_leftovers, validate
from sidecar.checkpoint.manifest import CheckpointInfo, Invalid
from sidecar.host.upload.location import S3Location
from sidecar.host.upload.s3_refs import read_references
from sidecar.host.upload.storage import StorageConfig, describe_error, make_client
from sidecar.host.upload.transfer import (
    download_files,
    list_remote_names,
    parse_manifest,
    read_remote_manifest,
)
from sidecar.host.upload.volume import (
    EXIT_NOTHING,
    Restored,
    RestoreError,
    already_there,
    check_copy,
    commit_folder,
    point_latest,
)

__all__ = ["find_complete", "restore"]

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
    client: Any, location: S3Location, step: Optional[int] = None
) -> tuple[Optional[RemoteCheckpoint], int]:
    """The newest complete remote checkpoint (or the one at ``step``) and the number of
    folders skipped because they have no manifest (partial uploads).

    Manifests are read in the order the folder names suggest (``step_00000300`` before
    ``step_00000200``), stopping once no unread name can hold a newer step.
    """
    names = sorted(list_remote_names(client, location), key=lambda n: (_name_step(n), n),
                   reverse=True)
    best: Optional[RemoteCheckpoint] = None
    incomplete = 0
    for name in names:
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
    """Download and commit the newest complete checkpoint under ``location`` into
    ``root``. Raises :class:`RestoreError` (one clear line) on any failure."""
    started = time.monotonic()
    client = client if client is not None else make_client(storage)
    try:
        found, incomplete = find_complete(client, location, step)
    except Exception as exc:
        raise RestoreError(describe_error(exc, storage, f"listing {location}")) from None
    if found is None:
        which = "complete checkpoint" if step is None else f"complete checkpoint at step {step}"
        extra = f" ({incomplete} folder(s) without a manifest: unfinished uploads)" \
            if incomplete else ""
        raise RestoreError(f"no {which} under {location}{extra}", EXIT_NOTHING)
    source = location.url.rstrip("/") + "/" + found.name + "/"
    root.mkdir(parents=True, exist_ok=True)
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

    def fill(temp: Path) -> None:
        try:
            download_files(client, storage, location, found.info, temp, on_progress=on_progress,
                           references=references)
        except Invalid as exc:
            raise RestoreError(f"{source}: {exc}") from None
        except Exception as exc:
            raise RestoreError(describe_error(exc, storage, f"downloading {source}")) from None
        try:
            check_copy(found.info, verify_checksums)(temp)
        except Invalid as exc:
            raise RestoreError(f"the downloaded checkpoint does not match its manifest: "
                               f"{exc}") from None

    commit_folder(root, found.name, found.manifest, fill)
    point_latest(root, found.name)
    try:
        info = validate(target)
    except CheckpointError as exc:  # pragma: no cover - checked before the rename
        raise RestoreError(str(exc)) from None
    return Restored(info, source, time.monotonic() - started, already_present=False)
