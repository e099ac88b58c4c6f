"""Restore from where the uploader put checkpoints: a volume or S3, by the URL's scheme.

``file:///PATH`` (a mounted volume) needs the standard library alone; ``s3://`` loads boto3
(the ``[upload]`` extra) only then. ``esi-sidecar restore`` and ``esi-sidecar run
--restore-from`` both come through here, so the two read a URL the same way.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

from sidecar.host.upload.location import parse_destination
from sidecar.host.upload.volume import Restored, RestoreError, restore_from_volume

__all__ = ["EXIT_USAGE", "restore_newest"]

EXIT_USAGE = 2  # a bad URL or boto3 missing: the call or the install is wrong


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
    try:
        where = parse_destination(source)
    except ValueError as exc:
        raise RestoreError(f"invalid source {source!r}: {exc}", EXIT_USAGE) from None
    if isinstance(where, Path):  # a mounted volume: no boto3 needed
        return restore_from_volume(where, target, step=step, verify_checksums=verify_checksums)
    try:
        from sidecar.host.upload.restore import restore
        from sidecar.host.upload.storage import StorageConfig
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise RestoreError(f"needs boto3 ({exc.name} is missing): pip install "
                           "'esi-sidecar[upload]'", EXIT_USAGE) from None
    return restore(StorageConfig(**storage), where, target, step=step,
                   verify_checksums=verify_checksums)
