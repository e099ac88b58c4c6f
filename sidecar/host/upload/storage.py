"""The S3 client (boto3) and its transfer settings; storage errors in one clear line.

Any S3-compatible service works: AWS S3, Volcengine TOS through its S3 endpoint
(``https://tos-s3-cn-beijing.volces.com``), MinIO, or moto on loopback in the tests.
Signing, retries of single requests, multipart and parallel parts are boto3's: nothing
here signs or splits by hand.

Credentials come from ``access_key``/``secret_key`` when given (the daemon's
``ESI_SIDECAR_UPLOAD_ACCESS_KEY``/``..._SECRET_KEY``), else from boto3's own chain
(``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, a profile, an instance role). They are
handed to boto3 and never logged, served or written anywhere; error messages are built
from error codes, not from request dumps.
"""

from __future__ import annotations

import ipaddress
import re
import urllib.parse
from typing import Any, Optional

import boto3
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectTimeoutError,
    EndpointConnectionError,
    NoCredentialsError,
    PartialCredentialsError,
    ReadTimeoutError,
)

from sidecar.checkpoint.manifest import Invalid
from sidecar.host.upload.storage_config import StorageConfig

__all__ = [
    "MIN_PART_SIZE",
    "StorageError",
    "describe_error",
    "is_access_denied",
    "is_invalid_range",
    "is_not_found",
    "make_client",
    "transfer_config",
]

MIB = 1 << 20
MIN_PART_SIZE = 5 * MIB  # S3's smallest part (all but the last)
MAX_PART_SIZE = 5 * 1024 * MIB
# A TOS S3 endpoint names its region: tos-s3-cn-beijing.volces.com -> cn-beijing.
_TOS_REGION = re.compile(r"^tos-s3-([a-z0-9-]+?)(?:\.ivolces|\.volces)\.com$")
_ACCESS_DENIED = frozenset({
    "AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403", "Forbidden",
    "ExpiredToken", "InvalidToken", "AccountProblem", "AllAccessDisabled",
})
_NOT_FOUND = frozenset({"404", "NoSuchKey", "NotFound", "NoSuchUpload"})


class StorageError(Exception):
    """A storage operation failed; the message is one line, without secrets."""


def _addressing_style(config: StorageConfig) -> str:
    """``auto``: path style for an IP address or localhost (moto, MinIO on a host port:
    a bucket cannot be a sub-domain there), virtual-hosted style for a named endpoint
    (TOS accepts only virtual-hosted requests), boto3's default without an endpoint."""
    if config.addressing_style != "auto" or config.endpoint is None:
        return config.addressing_style
    host = urllib.parse.urlsplit(config.endpoint).hostname or ""
    if host == "localhost":
        return "path"
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return "virtual"
    return "path"


def region_for(config: StorageConfig) -> Optional[str]:
    if config.region:
        return config.region
    if config.endpoint:
        host = urllib.parse.urlsplit(config.endpoint).hostname or ""
        match = _TOS_REGION.match(host)
        if match:
            return match.group(1)
        # Some signing region is needed; S3-compatible servers that do not check it
        # (MinIO, moto) accept any. boto3's chain (AWS_REGION, a profile) goes first.
        return boto3.session.Session().region_name or "us-east-1"
    return None


def make_client(config: StorageConfig) -> Any:
    """A boto3 S3 client for ``config``. Building it sends no request."""
    options: dict[str, Any] = {
        "connect_timeout": config.connect_timeout,
        "read_timeout": config.read_timeout,
        "retries": {"max_attempts": config.max_attempts, "mode": "standard"},
        "max_pool_connections": max(10, config.concurrency + 4),
        "s3": {"addressing_style": _addressing_style(config)},
    }
    if config.endpoint is not None:
        # boto3 >= 1.36 adds CRC checksums (and aws-chunked bodies) to every upload by
        # default, which several S3-compatible services reject. Only where the API needs
        # one; sizes are still checked after every upload (HeadObject).
        options["request_checksum_calculation"] = "when_required"
        options["response_checksum_validation"] = "when_required"
    session = boto3.session.Session(
        aws_access_key_id=config.access_key,
        aws_secret_access_key=config.secret_key,
    )
    return session.client(
        "s3",
        endpoint_url=config.endpoint,
        region_name=region_for(config),
        config=Config(**options),
    )


def transfer_config(config: StorageConfig) -> TransferConfig:
    """boto3's transfer settings: parts of ``part_size``, ``concurrency`` at once."""
    return TransferConfig(
        multipart_threshold=config.part_size,
        multipart_chunksize=config.part_size,
        max_concurrency=config.concurrency,
        use_threads=True,
        preferred_transfer_client="classic",
        max_bandwidth=config.max_bandwidth,
    )


def _code(exc: BaseException) -> str:
    if isinstance(exc, ClientError):
        error = exc.response.get("Error", {}) or {}
        code = str(error.get("Code") or "")
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return code or str(status or "")
    return ""


def is_access_denied(exc: BaseException) -> bool:
    return _code(exc) in _ACCESS_DENIED


def is_not_found(exc: BaseException) -> bool:
    return _code(exc) in _NOT_FOUND


def is_invalid_range(exc: BaseException) -> bool:
    """A ranged GET that starts past the object's end (416): the object is shorter."""
    return _code(exc) in ("InvalidRange", "416")


def describe_error(exc: BaseException, config: StorageConfig, what: str = "") -> str:
    """One line saying what went wrong, for logs, /v1/uploads and the restore command.

    Built from the error's class and code (never from a request dump, which could carry
    a signature), so it holds no secret."""
    where = config.where
    prefix = f"{what}: " if what else ""
    if isinstance(exc, (EndpointConnectionError, ConnectTimeoutError)):
        return f"{prefix}cannot reach the storage endpoint {where} (connection failed)"
    if isinstance(exc, ReadTimeoutError):
        return f"{prefix}the storage endpoint {where} did not answer in time"
    if isinstance(exc, (NoCredentialsError, PartialCredentialsError)):
        return (f"{prefix}no storage credentials: set ESI_SIDECAR_UPLOAD_ACCESS_KEY and "
                "ESI_SIDECAR_UPLOAD_SECRET_KEY, or AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY")
    if isinstance(exc, ClientError):
        code = _code(exc)
        message = str((exc.response.get("Error", {}) or {}).get("Message") or "").strip()
        message = message.splitlines()[0][:200] if message else ""
        if code in _ACCESS_DENIED:
            return (f"{prefix}access denied by {where} ({code}): check the credentials and "
                    "the bucket policy")
        if code == "NoSuchBucket":
            return f"{prefix}the bucket does not exist at {where} (NoSuchBucket)"
        detail = f" ({message})" if message else ""
        return f"{prefix}{code or 'error'} from {where}{detail}"
    if isinstance(exc, BotoCoreError):  # botocore's messages are templates, no secrets
        text = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        return f"{prefix}{text}"
    if isinstance(exc, (StorageError, Invalid)):  # Invalid: the local file (a link, ...)
        return f"{prefix}{exc}"
    text = str(exc).splitlines()[0][:200] if str(exc) else ""
    return f"{prefix}{type(exc).__name__}" + (f": {text}" if text else "")
