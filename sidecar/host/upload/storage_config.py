"""Where and how the uploader reaches S3-compatible storage: the settings alone.

Standard library only, so a daemon uploading to a mounted volume (``file://``), which
still reads ``max_bandwidth`` from here, never loads boto3; ``storage`` builds the boto3
client from these settings.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from sidecar.host.upload.plan import DEFAULT_UPLOAD_CONCURRENCY, DEFAULT_UPLOAD_PART_SIZE

__all__ = ["StorageConfig"]


@dataclass(frozen=True)
class StorageConfig:
    endpoint: Optional[str] = None  # None: AWS S3 for the region
    region: Optional[str] = None
    access_key: Optional[str] = field(default=None, repr=False)
    secret_key: Optional[str] = field(default=None, repr=False)
    addressing_style: str = "auto"  # auto | path | virtual
    concurrency: int = DEFAULT_UPLOAD_CONCURRENCY
    part_size: int = DEFAULT_UPLOAD_PART_SIZE
    max_bandwidth: Optional[int] = None  # bytes per second for all transfers; None: no cap
    connect_timeout: float = 10.0
    read_timeout: float = 60.0
    max_attempts: int = 3  # botocore's own retries of one request

    @property
    def where(self) -> str:
        return self.endpoint or "AWS S3"
