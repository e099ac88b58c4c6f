"""Unchanged files on S3 / TOS by reference: durable without moving a byte (issue 23, item 2).

A file of a new checkpoint whose size and sha256 equal a file of a durable checkpoint is
not sent and not copied at the commit: the new checkpoint's folder gets a hidden
``.esi-sidecar-references.json`` (written before ``MANIFEST.json``) saying which folder
holds that file's bytes, e.g. ``{"format": 1, "files": {"frozen.bin": "step_00000100"}}``.
``esi-sidecar restore`` reads each such file from that folder. The manifest itself stays
byte for byte the local one.

A reference is short-lived: once the uploader is idle again it copies each referenced
file into the new folder on the server side (:func:`materialize`, UploadPartCopy, which
moves no bytes over the link) and then deletes the references object, so every folder is
self-contained again within minutes and deleting an older folder (by hand or by a
lifecycle rule) cannot break a newer one. Until then the older folder must stay: the
daemon itself never deletes a remote folder.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping
from typing import Any, Callable, Optional

from botocore.exceptions import ClientError

from sidecar.checkpoint.manifest import Invalid
from sidecar.host.upload.location import S3Location
from sidecar.host.upload.storage import MAX_PART_SIZE, is_not_found
from sidecar.host.upload.volume_stage import Cancelled

__all__ = ["REFERENCES_NAME", "materialize", "read_references", "source_key", "write_references"]

REFERENCES_NAME = ".esi-sidecar-references.json"
FORMAT = 1
COPY_PART_SIZE = 256 << 20  # a materialize stops between parts of this size
MAX_PARTS = 10_000


def _valid_folder(name: object) -> bool:
    return (isinstance(name, str) and bool(name) and "/" not in name
            and name not in (".", "..") and not name.startswith("."))


def parse_references(raw: bytes) -> dict[str, str]:
    """``{relative path: folder holding its bytes}``; :class:`Invalid` with the reason."""
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise Invalid(f"{REFERENCES_NAME} is not JSON: {exc}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise Invalid(f"{REFERENCES_NAME} has no format {FORMAT}")
    files = data.get("files")
    if not isinstance(files, dict):
        raise Invalid(f"{REFERENCES_NAME} has no 'files' object")
    for relative, folder in files.items():
        if not isinstance(relative, str) or not relative or not _valid_folder(folder):
            raise Invalid(f"{REFERENCES_NAME} names an unsafe folder for {relative!r}: "
                          f"{folder!r}")
    return dict(files)


def read_references(client: Any, location: S3Location, name: str) -> dict[str, str]:
    """The references of checkpoint ``name`` (empty when it holds all its files)."""
    try:
        response = client.get_object(Bucket=location.bucket,
                                     Key=location.key(name, REFERENCES_NAME))
    except ClientError as exc:
        if is_not_found(exc):
            return {}
        raise
    return parse_references(response["Body"].read())


def write_references(client: Any, location: S3Location, name: str,
                     references: Mapping[str, str]) -> None:
    """Write them, or delete the object when there are none (a re-save's stale ones)."""
    key = location.key(name, REFERENCES_NAME)
    if not references:
        client.delete_object(Bucket=location.bucket, Key=key)  # no error when absent
        return
    body = json.dumps({"format": FORMAT, "files": dict(sorted(references.items()))},
                      indent=1).encode()
    client.put_object(Bucket=location.bucket, Key=key, Body=body,
                      ContentType="application/json")


def source_key(location: S3Location, name: str, relative: str,
               references: Mapping[str, str]) -> str:
    """Where the bytes of ``name``'s file ``relative`` are."""
    return location.key(references.get(relative, name), relative)


def copy_parts(size: int) -> list[tuple[int, int]]:
    """Inclusive byte ranges of a server-side copy: small enough to stop between, few
    enough for S3's 10,000 parts, none over its 5 GiB."""
    part = min(MAX_PART_SIZE, max(COPY_PART_SIZE, -(-size // MAX_PARTS)))
    return [(start, min(size, start + part) - 1) for start in range(0, size, part)]


def materialize(client: Any, location: S3Location, name: str,
                should_stop: Callable[[], Optional[str]]) -> int:
    """Copy every referenced file of ``name`` into its own folder (server side), then
    delete the references. Returns the files copied. Raises :class:`Cancelled` between
    parts when ``should_stop`` says so (the references stay valid: restore still reads
    the older folder), boto3's errors otherwise."""
    references = read_references(client, location, name)
    left = dict(references)
    bucket = location.bucket
    for relative, folder in sorted(references.items()):
        source = {"Bucket": bucket, "Key": location.key(folder, relative)}
        size = int(client.head_object(**source)["ContentLength"])
        key = location.key(name, relative)
        upload_id = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
        try:
            parts = []
            for number, (start, end) in enumerate(copy_parts(size), start=1):
                reason = should_stop()
                if reason is not None:
                    raise Cancelled(reason)
                answer = client.upload_part_copy(
                    Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=number,
                    CopySource=source, CopySourceRange=f"bytes={start}-{end}")
                parts.append({"PartNumber": number, "ETag": answer["CopyPartResult"]["ETag"]})
            client.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id,
                                             MultipartUpload={"Parts": parts})
        except BaseException:
            with contextlib.suppress(Exception):  # else the next start's prepare does
                client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id)
            raise
        del left[relative]
        write_references(client, location, name, left)  # a stop keeps what was done
    return len(references)
