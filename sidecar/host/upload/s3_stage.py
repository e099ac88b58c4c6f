"""A checkpoint's files in S3 / TOS before it is visible: one multipart upload per file,
completed only when the manifest has landed and every file passed the commit check
(issue 23, items 1 and 2).

An incomplete multipart upload is invisible to every reader (no listing, no GET), so a
file can go up while the save still writes the next one and nothing of the checkpoint
shows until :meth:`S3Staging.finish`: (1) a remote manifest that differs is deleted
first, so old and new files never look complete together; (2) every upload is
completed; (3) every object's size is read back (HeadObject); (4) ``MANIFEST.json`` is
written last. An unchanged file is not sent: its size is checked at the durable
checkpoint that holds it (HeadObject) and the new checkpoint refers to it there
(``s3_refs``: a hidden references object written before the manifest, no bytes moved, so
durable at once; the uploader copies it server-side later). Abandoned uploads are aborted
(:meth:`S3Staging.discard`), and a killed daemon's by the next start
(``S3Destination.prepare``).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Optional

from botocore.exceptions import ClientError

from sidecar.checkpoint.manifest import CheckpointInfo, FileEntry
from sidecar.host.upload.commit_check import DurableFile, StagedFile, StatKey, stat_key
from sidecar.host.upload.jobfiles import open_job_file
from sidecar.host.upload.location import S3Location
from sidecar.host.upload.s3_refs import source_key, write_references
from sidecar.host.upload.storage import StorageError, is_not_found
from sidecar.host.upload.storage_config import StorageConfig
from sidecar.host.upload.volume_stage import Cancelled, Throttle

__all__ = ["S3Staging", "read_remote_manifest", "verify_sizes"]

WAIT_SLICE_SECONDS = 0.2
Phase = Callable[[str, Any], None]


def read_remote_manifest(client: Any, location: S3Location, name: str) -> Optional[bytes]:
    """The remote manifest's bytes, or None when there is none (an incomplete folder)."""
    try:
        response = client.get_object(Bucket=location.bucket, Key=location.manifest_key(name))
    except ClientError as exc:
        if is_not_found(exc):
            return None
        raise
    body: bytes = response["Body"].read()
    return body


def verify_sizes(client: Any, storage: StorageConfig, location: S3Location, name: str,
                 files: Sequence[FileEntry],
                 references: Mapping[str, str] = MappingProxyType({})) -> None:
    """Every object's size (HeadObject; a referenced file's where its bytes are) is the
    manifest's, else :class:`StorageError`."""
    def check(entry: FileEntry) -> None:
        head = client.head_object(Bucket=location.bucket,
                                  Key=source_key(location, name, entry.path, references))
        if int(head["ContentLength"]) != entry.size:
            raise StorageError(
                f"{entry.path}: stored object is {head['ContentLength']} bytes, the manifest "
                f"says {entry.size}"
            )

    with ThreadPoolExecutor(max_workers=max(1, min(storage.concurrency, len(files) or 1))) as pool:
        list(pool.map(check, files))


class S3Staging:
    """One checkpoint's unfinished multipart uploads (the ``commit_check.Staging`` protocol)."""

    def __init__(self, client: Any, storage: StorageConfig, location: S3Location, name: str,
                 *, phase: Phase = lambda name, detail: None) -> None:
        self.client = client
        self.storage = storage
        self.location = location
        self.name = name
        self._phase = phase
        self.files: dict[str, StagedFile] = {}
        self._uploads: dict[str, tuple[str, list[dict[str, Any]]]] = {}  # id, parts
        self._references: dict[str, str] = {}  # unchanged file -> the folder holding it
        self._lock = threading.Lock()
        self._sent = 0  # every part's bytes, for the test seam's "progress"
        self._file_sent = 0  # the file being sent, taken back if it is not kept

    def _key(self, relative: str) -> str:
        return self.location.key(self.name, relative)

    def _abort(self, relative: str, upload_id: str) -> None:
        try:
            self.client.abort_multipart_upload(Bucket=self.location.bucket,
                                               Key=self._key(relative), UploadId=upload_id)
        except ClientError as exc:
            if not is_not_found(exc):
                raise

    def send(self, folder: Path, relative: str, *, on_progress: Callable[[int], None],
             should_stop: Callable[[], Optional[str]]) -> Optional[StagedFile]:
        self.drop(relative)
        handle = open_job_file(folder, relative)
        upload_id: Optional[str] = None
        self._file_sent = 0
        try:
            before = stat_key(os.fstat(handle))
            if before[1] == 0:  # nothing to upload in parts: an empty object at the commit
                parts: list[dict[str, Any]] = []
                upload_id, count, digest = "", 0, hashlib.sha256().hexdigest()
            else:
                upload_id = self.client.create_multipart_upload(
                    Bucket=self.location.bucket, Key=self._key(relative))["UploadId"]
                parts, count, digest = self._send_parts(
                    handle, relative, upload_id, on_progress, should_stop)
            after = stat_key(os.fstat(handle))
        except BaseException:
            if upload_id:
                self._abort(relative, upload_id)
            on_progress(-self._file_sent)
            raise
        finally:
            os.close(handle)
        if before != after or count != after[1]:  # written to while it was read
            if upload_id:
                self._abort(relative, upload_id)
            on_progress(-self._file_sent)
            return None
        self._uploads[relative] = (upload_id, parts)
        staged = StagedFile(relative, count, digest, after)
        self.files[relative] = staged
        return staged

    def _send_parts(self, handle: int, relative: str, upload_id: str,
                    on_progress: Callable[[int], None],
                    should_stop: Callable[[], Optional[str]],
                    ) -> tuple[list[dict[str, Any]], int, str]:
        """Read the file once, hashing it, and send its parts (``concurrency`` at once)."""
        hasher = hashlib.sha256()
        throttle = Throttle(self.storage.max_bandwidth)  # per file: no credit from idling
        part_size = self.storage.part_size
        parts: dict[int, str] = {}
        count = 0

        def put(number: int, body: bytes) -> None:
            answer = self.client.upload_part(
                Bucket=self.location.bucket, Key=self._key(relative), UploadId=upload_id,
                PartNumber=number, Body=body)
            with self._lock:
                parts[number] = answer["ETag"]
                self._file_sent += len(body)
                self._sent += len(body)
                total = self._sent
                on_progress(len(body))
            self._phase("progress", total)

        in_flight: set[Future[None]] = set()
        pool = ThreadPoolExecutor(max_workers=max(1, self.storage.concurrency))
        try:
            number = 0
            while True:
                body = _read_full(handle, part_size)
                if not body:
                    break
                hasher.update(body)
                count += len(body)
                number += 1
                throttle(len(body))
                in_flight.add(pool.submit(put, number, body))
                while len(in_flight) >= max(1, self.storage.concurrency):
                    in_flight = self._wait(in_flight, should_stop)
            while in_flight:
                in_flight = self._wait(in_flight, should_stop)
        finally:
            for future in in_flight:
                future.cancel()
            pool.shutdown(wait=True)
        listed = [{"PartNumber": n, "ETag": parts[n]} for n in sorted(parts)]
        return listed, count, hasher.hexdigest()

    def _wait(self, in_flight: set[Future[None]],
              should_stop: Callable[[], Optional[str]]) -> set[Future[None]]:
        done, pending = wait(in_flight, timeout=WAIT_SLICE_SECONDS, return_when=FIRST_COMPLETED)
        for future in done:
            future.result()  # the first failure, as boto3 raised it
        reason = should_stop()
        if reason is not None:
            self._phase("cancelling", reason)
            raise Cancelled(reason)
        return set(pending)

    def copy(self, relative: str, durable: DurableFile, key: StatKey) -> Optional[StagedFile]:
        """Refer to the durable checkpoint's equal file (``s3_refs``), once HeadObject
        shows it there at its size: nothing is sent or copied now."""
        if durable.size == 0:
            return None  # an empty object costs no bytes either way
        self.drop(relative)
        try:
            head = self.client.head_object(
                Bucket=self.location.bucket, Key=self.location.key(durable.checkpoint, relative))
        except ClientError:
            return None  # the caller sends the bytes
        if int(head["ContentLength"]) != durable.size:
            return None
        self._references[relative] = durable.checkpoint
        staged = StagedFile(relative, durable.size, durable.sha256, key,
                            stored_in=durable.checkpoint)
        self.files[relative] = staged
        return staged

    def drop(self, relative: str) -> None:
        self.files.pop(relative, None)
        self._references.pop(relative, None)
        upload = self._uploads.pop(relative, None)
        if upload is not None and upload[0]:
            self._abort(relative, upload[0])

    def finish(self, info: CheckpointInfo, manifest: bytes) -> None:
        bucket, name = self.location.bucket, self.name
        remote = read_remote_manifest(self.client, self.location, name)
        if remote is not None and remote != manifest:
            # A re-save under the same name: from here on the remote folder is incomplete.
            self.client.delete_object(Bucket=bucket, Key=self.location.manifest_key(name))
            self._phase("stale-manifest-deleted", name)

        def complete(relative: str) -> None:
            upload_id, parts = self._uploads[relative]
            if not upload_id:
                self.client.put_object(Bucket=bucket, Key=self._key(relative), Body=b"")
                return
            self.client.complete_multipart_upload(
                Bucket=bucket, Key=self._key(relative), UploadId=upload_id,
                MultipartUpload={"Parts": parts})

        workers = max(1, min(self.storage.concurrency, len(self._uploads) or 1))
        with ThreadPoolExecutor(max_workers=workers) as pool:
            list(pool.map(complete, [entry.path for entry in info.files
                                     if entry.path not in self._references]))
        self._uploads.clear()
        self._phase("files-uploaded", name)
        # Before the manifest, and always: a re-save under this name drops stale ones.
        write_references(self.client, self.location, name, self._references)
        verify_sizes(self.client, self.storage, self.location, name, info.files,
                     self._references)
        self._phase("sizes-verified", name)
        self.client.put_object(Bucket=bucket, Key=self.location.manifest_key(name),
                               Body=manifest, ContentType="application/json")
        self._phase("manifest-written", name)

    def discard(self) -> None:
        for relative in list(self._uploads):
            # One that fails is aborted by the next start's prepare at the latest.
            with contextlib.suppress(Exception):
                self.drop(relative)
        self.files.clear()
        self._references.clear()


def _read_full(handle: int, size: int) -> bytes:
    """Up to ``size`` bytes (less only at the end of the file)."""
    chunks, left = [], size
    while left > 0:
        chunk = os.read(handle, left)
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)
