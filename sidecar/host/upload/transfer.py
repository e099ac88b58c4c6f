"""S3 / TOS with boto3: the uploader's destination and the way back down.

Up: :class:`S3Destination` commits a checkpoint through ``s3_stage`` (multipart uploads
completed only once the manifest landed and every file passed the commit check, the
manifest last; an unchanged file by reference, ``s3_refs``). A kill at any point leaves a
remote folder without a manifest, which restore never takes for a checkpoint.
Down: listing the remote folders, parsing a manifest with the checkpoint module's own
reader, and downloading the files a manifest lists (each from the folder that holds it).
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Optional

from boto3.s3.transfer import create_transfer_manager
from s3transfer.subscribers import BaseSubscriber

from sidecar.checkpoint.manifest import (
    MANIFEST_NAME,
    CheckpointInfo,
    Invalid,
    read_manifest,
)
from sidecar.host.upload.commit_check import DurableFile, StagingDestination, durable_entries
from sidecar.host.upload.location import S3Location
from sidecar.host.upload.s3_refs import materialize, read_references, source_key
from sidecar.host.upload.s3_stage import S3Staging, read_remote_manifest
from sidecar.host.upload.storage import describe_error, transfer_config
from sidecar.host.upload.storage_config import StorageConfig
from sidecar.host.upload.volume import Cancelled  # one class for both destinations
from sidecar.host.upload.volume_stage import Throttle

log = logging.getLogger("sidecar.host.upload.transfer")

__all__ = [
    "Cancelled",
    "S3Destination",
    "download_files",
    "list_remote_names",
    "parse_manifest",
    "read_remote_manifest",
]

WAIT_SLICE_SECONDS = 0.2
PROBE_FOLDER = ".esi-sidecar-probe"  # hidden: listings skip names starting with a dot

# Test seam: called with (phase, detail) at each step of an upload, so the crash tests
# can stop a daemon subprocess at an exact point without sleeping. Never set in
# production (the same pattern as sidecar.checkpoint.folders._phase_hook).
_phase_hook: Optional[Callable[[str, Any], None]] = None


def _phase(name: str, detail: Any = None) -> None:
    if _phase_hook is not None:
        _phase_hook(name, detail)


class _Progress(BaseSubscriber):
    def __init__(self, on_progress: Callable[[int], None], finished: threading.Event) -> None:
        self._on_progress = on_progress
        self._finished = finished
        self._lock = threading.Lock()
        self.total = 0

    def on_progress(self, future: Any, bytes_transferred: int, **kwargs: Any) -> None:
        with self._lock:
            self.total += bytes_transferred
            total = self.total
        self._on_progress(bytes_transferred)
        _phase("progress", total)

    def on_done(self, future: Any, **kwargs: Any) -> None:
        self._finished.set()


def _opened(handle: int) -> Any:
    """What boto3 reads for an open file: its /proc/self/fd name (boto3 reopens it for
    each part, in parallel, and the name can only reach that same file), else the file
    object itself (read in order)."""
    name = f"/proc/self/fd/{handle}"
    if os.path.exists(name):
        return name
    return os.fdopen(os.dup(handle), "rb")


def parse_manifest(raw: bytes, folder: Path) -> CheckpointInfo:
    """Parse manifest bytes with the checkpoint module's own reader (one format, one
    parser). Raises ``Invalid`` with the reason."""
    with tempfile.TemporaryDirectory(prefix="esi-sidecar-manifest-") as scratch:
        (Path(scratch) / MANIFEST_NAME).write_bytes(raw)
        info = read_manifest(Path(scratch))
    return CheckpointInfo(folder, info.step, info.created_at, info.total_bytes, info.metadata,
                          info.files)


def list_remote_names(client: Any, location: S3Location) -> list[str]:
    """Folder names directly under the prefix (complete or not)."""
    names = []
    paginator = client.get_paginator("list_objects_v2")
    for page in paginator.paginate(
        Bucket=location.bucket, Prefix=location.listing_prefix, Delimiter="/"
    ):
        for common in page.get("CommonPrefixes", []) or []:
            name = common["Prefix"][len(location.listing_prefix):].rstrip("/")
            if name and not name.startswith("."):
                names.append(name)
    return names


def _wait(
    futures: Sequence[Any], finished: threading.Event, should_stop: Callable[[], Optional[str]]
) -> None:
    """Wait for every transfer; cancel them all when ``should_stop`` gives a reason."""
    while not all(future.done() for future in futures):
        finished.wait(WAIT_SLICE_SECONDS)
        finished.clear()
        reason = should_stop()
        if reason is not None:
            _phase("cancelling", reason)
            for future in futures:
                future.cancel()  # boto3 aborts the multipart uploads it started
            raise Cancelled(reason)


def _run_transfers(
    client: Any,
    storage: StorageConfig,
    submit: Callable[[Any, BaseSubscriber], list[Any]],
    on_progress: Callable[[int], None],
    should_stop: Callable[[], Optional[str]],
) -> None:
    finished = threading.Event()
    progress = _Progress(on_progress, finished)
    manager = create_transfer_manager(client, transfer_config(storage))
    try:
        futures = submit(manager, progress)
        _wait(futures, finished, should_stop)
        for future in futures:
            future.result()  # the first failure, as boto3 raised it
    finally:
        manager.shutdown()  # waits for cancelled transfers to wind down


def download_files(
    client: Any,
    storage: StorageConfig,
    location: S3Location,
    info: CheckpointInfo,
    into: Path,
    *,
    on_progress: Callable[[int], None] = lambda count: None,
    should_stop: Callable[[], Optional[str]] = lambda: None,
    references: Mapping[str, str] = MappingProxyType({}),
) -> None:
    """Download every file the manifest lists into ``into`` (parallel, ranged GETs); a
    file in ``references`` from the older folder that holds it (``s3_refs``)."""
    for entry in info.files:
        target = into / entry.path
        if into.resolve() not in target.resolve().parents:  # read_manifest checks too
            raise Invalid(f"manifest lists an unsafe path: {entry.path!r}")
        target.parent.mkdir(parents=True, exist_ok=True)

    def submit(manager: Any, progress: BaseSubscriber) -> list[Any]:
        return [
            manager.download(location.bucket,
                             source_key(location, info.name, entry.path, references),
                             str(into / entry.path), subscribers=[progress])
            for entry in info.files
        ]

    _run_transfers(client, storage, submit, on_progress, should_stop)


class S3Destination(StagingDestination):
    """The uploader's destination in S3 / TOS (a ``VolumeDestination`` is the other kind):
    one boto3 client, made on first use and again after a failure."""

    def __init__(self, storage: StorageConfig, location: S3Location,
                 client_factory: Callable[[StorageConfig], Any]) -> None:
        self.storage = storage
        self.location = location
        self._client_factory = client_factory
        self._client: Optional[Any] = None

    @property
    def url(self) -> str:
        return self.location.url

    @property
    def endpoint(self) -> Optional[str]:
        return self.storage.endpoint

    @property
    def where(self) -> str:
        return self.storage.where

    def client(self) -> Any:
        if self._client is None:
            self._client = self._client_factory(self.storage)
        return self._client

    def prepare(self, started_at_unix: float) -> None:
        """Abort multipart uploads under our prefix begun before this start: a killed
        daemon's. They are invisible to readers but cost storage until aborted."""
        client = self.client()
        location = self.location
        paginator = client.get_paginator("list_multipart_uploads")
        aborted = 0
        for page in paginator.paginate(Bucket=location.bucket, Prefix=location.listing_prefix):
            for upload in page.get("Uploads", []) or []:
                initiated = upload.get("Initiated")
                if initiated is not None and initiated.timestamp() >= started_at_unix:
                    continue
                client.abort_multipart_upload(
                    Bucket=location.bucket, Key=upload["Key"], UploadId=upload["UploadId"]
                )
                aborted += 1
        if aborted:
            log.info("aborted %d unfinished multipart upload(s) under %s", aborted, location)

    def remote_manifest(self, name: str) -> Optional[bytes]:
        return read_remote_manifest(self.client(), self.location, name)

    def open_staging(self, name: str) -> S3Staging:
        """Unfinished multipart uploads for ``name``'s files until its manifest lands."""
        return S3Staging(self.client(), self.storage, self.location, name, phase=_phase)

    def durable_files(self, name: str) -> dict[str, DurableFile]:
        """The files of the durable checkpoint ``name`` whose sha256 its manifest records,
        each in the folder that holds its bytes (``s3_refs``)."""
        client = self.client()
        raw = read_remote_manifest(client, self.location, name)
        if raw is None:
            return {}
        try:
            info = parse_manifest(raw, Path(name))
            references = read_references(client, self.location, name)
        except Invalid:
            return {}
        return durable_entries(name, info, references)

    def make_self_contained(self, name: str, should_stop: Callable[[], Optional[str]]) -> int:
        """Copy the files ``name`` refers to into its folder, server side (``s3_refs``)."""
        return materialize(self.client(), self.location, name, should_stop)

    def probe(self, amount: int, should_stop: Callable[[], Optional[str]]) -> None:
        """``amount`` bytes sent as the parts of a multipart upload under a hidden folder
        (at the uploads' cap and concurrency), which is then aborted: nothing becomes
        visible (``probe.LinkProbe``; ``prepare`` aborts one a kill left)."""
        client, bucket = self.client(), self.location.bucket
        key = self.location.key(PROBE_FOLDER, "probe")
        upload_id = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
        throttle = Throttle(self.storage.max_bandwidth)
        part = os.urandom(max(1, min(amount, self.storage.part_size)))
        try:
            with ThreadPoolExecutor(max_workers=max(1, self.storage.concurrency)) as pool:
                futures, left, number = [], amount, 0
                while left > 0:
                    reason = should_stop()
                    if reason is not None:
                        raise Cancelled(reason)
                    body = part[:left]
                    number += 1
                    throttle(len(body))
                    futures.append(pool.submit(client.upload_part, Bucket=bucket, Key=key,
                                               UploadId=upload_id, PartNumber=number,
                                               Body=body))
                    left -= len(body)
                for future in futures:
                    future.result()
        finally:
            client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id)

    def describe_error(self, exc: BaseException, doing: str) -> str:
        return describe_error(exc, self.storage, doing)

    def reset(self) -> None:
        self._client = None  # a fresh client (and connection pool) for the next attempt
