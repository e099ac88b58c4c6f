"""S3 / TOS as a ``verified_copy.Source``: each range of a file is one ranged GET, its body
read in pieces straight into place and into the file's hash (issue 40, item 1).

boto3's transfer manager downloads to a path (a temporary name it opens itself, through
any link) and writes every file's parts from one I/O thread; hashing there would put all
files on one core, and its parts arrive out of order. So the GETs are our own, on the
bounded pool of ``verified_copy`` (``StorageConfig.concurrency`` threads), with botocore's
retries of each request and s3transfer's list of errors that end a body early: such a
range is asked again from the first byte not yet received, up to ``RANGE_ATTEMPTS``.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Mapping
from typing import Any, Optional

from botocore.exceptions import ClientError, IncompleteReadError
from s3transfer.utils import S3_RETRYABLE_DOWNLOAD_ERRORS

from sidecar.checkpoint.manifest import FileEntry, Invalid
from sidecar.host.upload.storage import StorageError, is_invalid_range, is_not_found
from sidecar.host.upload.verified_copy import CHUNK_SIZE, Sink, size_mismatch
from sidecar.host.upload.volume_stage import Throttle

__all__ = ["RANGE_ATTEMPTS", "S3Source"]

log = logging.getLogger("sidecar.host.upload.s3_source")

RANGE_ATTEMPTS = 3  # GETs of one range whose body broke off before giving up (s3transfer: 5)
_CONTENT_RANGE = re.compile(r"^bytes (\d+)-(\d+)/(\d+)$")


class S3Source:
    """The files of one remote checkpoint; ``keys``: each file's object key (the folder
    that holds its bytes, ``s3_refs``). ``max_bandwidth``: bytes per second for all the
    GETs together (the uploads' cap, ``StorageConfig.max_bandwidth``); None: no cap."""

    def __init__(self, client: Any, bucket: str, keys: Mapping[str, str],
                 max_bandwidth: Optional[int] = None) -> None:
        self.client = client
        self.bucket = bucket
        self.keys = keys
        self._throttle = Throttle(max_bandwidth)
        self._throttle_lock = threading.Lock()

    def read(self, entry: FileEntry, offset: int, length: int, sink: Sink) -> None:
        done, broken = 0, 0
        while True:
            body = self._open(entry, offset + done, offset + length)
            try:
                while done < length:
                    piece = body.read(min(CHUNK_SIZE, length - done))
                    if not piece:
                        raise IncompleteReadError(actual_bytes=done, expected_bytes=length)
                    sink(offset + done, piece)
                    done += len(piece)
                    if self._throttle.rate:
                        with self._throttle_lock:  # one budget: the threads take turns
                            self._throttle(len(piece))
                return
            except S3_RETRYABLE_DOWNLOAD_ERRORS as exc:
                broken += 1
                if broken >= RANGE_ATTEMPTS:
                    raise
                log.info("the GET of %s broke off at byte %d (%s); asking again", entry.path,
                         offset + done, type(exc).__name__)
            finally:
                body.close()

    def _open(self, entry: FileEntry, start: int, end: int) -> Any:
        """The body of bytes ``[start, end)`` (the whole object for an empty file), once
        the object's size is the manifest's."""
        key = self.keys[entry.path]
        response = None
        try:
            if entry.size == 0:
                response = self.client.get_object(Bucket=self.bucket, Key=key)
                total = int(response["ContentLength"])
            else:
                response = self.client.get_object(Bucket=self.bucket, Key=key,
                                                  Range=f"bytes={start}-{end - 1}")
                total = self._total(response, start)
        except ClientError as exc:
            if is_not_found(exc):
                raise Invalid(f"file {entry.path} listed in the manifest is missing") from None
            if not is_invalid_range(exc):
                raise
            total = int(self.client.head_object(Bucket=self.bucket, Key=key)["ContentLength"])
        if response is None or total != entry.size:
            if response is not None:
                response["Body"].close()
            raise size_mismatch(entry, total)
        return response["Body"]

    @staticmethod
    def _total(response: Mapping[str, Any], start: int) -> int:
        match = _CONTENT_RANGE.match(str(response.get("ContentRange") or ""))
        if match is None:
            if start == 0:  # the whole object: the body starts where the range does
                return int(response["ContentLength"])
            response["Body"].close()
            raise StorageError("the storage answered a ranged GET without Content-Range")
        if int(match.group(1)) != start:
            response["Body"].close()
            raise StorageError(f"the storage answered bytes from {match.group(1)}, "
                               f"not from {start}")
        return int(match.group(3))
