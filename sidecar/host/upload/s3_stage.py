"""A checkpoint's files in S3 / TOS before it is visible: one multipart upload per file,
completed only when the manifest has landed and every file passed the commit check
(issue 23, items 1 and 2).

An incomplete multipart upload is invisible to every reader (no listing, no GET), so a
file can go up while the save still writes the next one and nothing of the checkpoint
shows until :meth:`S3Staging.finish`: (1) a remote manifest that differs is deleted
first, so old and new files never look complete together; (2) every upload is
completed; (3) every object's size is read back (HeadObject); (4) ``MANIFEST.json`` is
written last. An unchanged file is copied from the durable checkpoint's object inside
the same kind of upload (UploadPartCopy, parts of at most 5 GiB: a server-side copy that
stays invisible until the commit, unlike CopyObject, which would overwrite a visible
object at once). Abandoned uploads are aborted (:meth:`S3Staging.discard`), and a killed
daemon's by the next start (``S3Destination.prepare``).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, Callable, Optional

from botocore.exceptions import ClientError

from sidecar.checkpoint.manifest import CheckpointInfo, FileEntry, open_listed
from sidecar.host.upload.commit_check import DurableFile, StagedFile, StatKey, stat_key
from sidecar.host.upload.location import S3Location
from sidecar.host.upload.storage import (
    MAX_PART_SIZE,
    StorageConfig,
    StorageError,
    is_not_found,
)
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
                 files: Sequence[FileEntry]) -> None:
    """Every object's size (HeadObject) is the manifest's, else :class:`StorageError`."""
    def check(entry: FileEntry) -> None:
        head = client.head_object(Bucket=location.bucket, Key=location.key(name, entry.path))
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
        handle = open_listed(folder, relative)
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
        if durable.size == 0:
            return None  # nothing to copy: an empty object costs no bytes either way
        source = {"Bucket": self.location.bucket,
                  "Key": self.location.key(durable.checkpoint, relative)}
        self.drop(relative)
        upload_id = ""
        try:
            head = self.client.head_object(**source)
            if int(head["ContentLength"]) != durable.size:
                return None
            upload_id = self.client.create_multipart_upload(
                Bucket=self.location.bucket, Key=self._key(relative))["UploadId"]
            parts = []
            for number, start in enumerate(range(0, durable.size, MAX_PART_SIZE), start=1):
                end = min(durable.size, start + MAX_PART_SIZE) - 1
                answer = self.client.upload_part_copy(
                    Bucket=self.location.bucket, Key=self._key(relative), UploadId=upload_id,
                    PartNumber=number, CopySource=source, CopySourceRange=f"bytes={start}-{end}")
                parts.append({"PartNumber": number, "ETag": answer["CopyPartResult"]["ETag"]})
        except ClientError:
            if upload_id:
                self._abort(relative, upload_id)
            return None  # the caller sends the bytes
        self._uploads[relative] = (upload_id, parts)
        staged = StagedFile(relative, durable.size, durable.sha256, key,
                            copied_from=durable.checkpoint)
        self.files[relative] = staged
        return staged

    def drop(self, relative: str) -> None:
        self.files.pop(relative, None)
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
            list(pool.map(complete, [entry.path for entry in info.files]))
        self._uploads.clear()
        self._phase("files-uploaded", name)
        verify_sizes(self.client, self.storage, self.location, name, info.files)
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
