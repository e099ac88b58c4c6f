"""Restore from where the uploader put checkpoints: a volume or S3, by the URL's scheme.

``file:///PATH`` (a mounted volume) needs the standard library alone; ``s3://`` loads boto3
(the ``[upload]`` extra) only then. ``esi-sidecar restore`` and ``esi-sidecar run
--restore-from`` both come through here, so the two read a URL the same way.

Either way the files are copied in parallel (files, and ranges of a large file), each
byte hashed as it is written and never read back (``verified_copy``), then committed as
a save is: nothing appears under the checkpoint's name before it is complete.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

from sidecar.checkpoint.folders import validate
from sidecar.checkpoint.manifest import CheckpointError, Invalid
from sidecar.host.upload.location import parse_destination
from sidecar.host.upload.volume import (
    Restored,
    RestoreError,
    restore_checkpoint,
    restore_from_volume,
)

__all__ = ["EXIT_USAGE", "restore_named", "restore_newest"]

EXIT_USAGE = 2  # a bad URL or boto3 missing: the call or the install is wrong


def _where(source: str) -> Any:
    try:
        return parse_destination(source)
    except ValueError as exc:
        raise RestoreError(f"invalid source {source!r}: {exc}", EXIT_USAGE) from None


def _needs_boto3(exc: ImportError) -> RestoreError:  # pragma: no cover - the install
    return RestoreError(f"needs boto3 ({exc.name} is missing): pip install "
                        "'esi-sidecar[upload]'", EXIT_USAGE)


def restore_newest(
    source: str,
    target: Path,
    storage: Mapping[str, Any],
    *,
    step: Optional[int] = None,
    verify_checksums: bool = True,
) -> Restored:
    """The newest complete checkpoint under ``source`` (or the one at ``step``) committed
    into ``target``. ``storage``: ``StorageConfig``'s arguments (endpoint, keys), read for
    S3 only. Raises :class:`RestoreError` (one line and its exit code)."""
    where = _where(source)
    if isinstance(where, Path):  # a mounted volume: no boto3 needed
        return restore_from_volume(where, target, step=step, verify_checksums=verify_checksums)
    try:
        from sidecar.host.upload.restore import restore
        from sidecar.host.upload.storage_config import StorageConfig
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise _needs_boto3(exc) from None
    return restore(StorageConfig(**storage), where, target, step=step,
                   verify_checksums=verify_checksums)


def restore_named(
    source: str,
    name: str,
    target: Path,
    storage: Mapping[str, Any],
    *,
    verify_checksums: bool = True,
) -> Restored:
    """The complete checkpoint ``name`` under ``source`` committed into ``target`` (no
    fallback to another one; already there: ``already_present``). Raises
    :class:`RestoreError` (one line and its exit code)."""
    where = _where(source)
    if isinstance(where, Path):
        try:
            found = validate(where / name)
        except (CheckpointError, OSError) as exc:
            raise RestoreError(f"{where / name} is not a complete checkpoint: {exc}") from None
        try:
            return restore_checkpoint(found, target, verify_checksums=verify_checksums)
        except Invalid as exc:
            raise RestoreError(f"{found.path}: {exc}") from None
    try:
        from sidecar.host.upload.restore import restore_named as restore_remote
        from sidecar.host.upload.storage_config import StorageConfig
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise _needs_boto3(exc) from None
    return restore_remote(StorageConfig(**storage), where, name, target,
                          verify_checksums=verify_checksums)
