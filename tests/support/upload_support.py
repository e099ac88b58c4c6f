"""Shared pieces of the upload tests (no tests here): a real S3-protocol server on
loopback (moto's standalone server, spoken to over HTTP by the real boto3), checkpoints
with random bytes, and waiting with a deadline.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional

import pytest

pytest.importorskip("moto.server", reason="moto[server] runs the S3 server for these tests")
pytest.importorskip("boto3", reason="the uploader needs boto3 (the [server] extra)")

from daemon_harness import wait_for
from moto.server import ThreadedMotoServer

from sidecar.checkpoint.folders import CheckpointInfo, atomic_checkpoint
from sidecar.checkpoint.manifest import MANIFEST_NAME
from sidecar.host.upload.location import S3Location
from sidecar.host.upload.status import UploadRecord
from sidecar.host.upload.storage import make_client
from sidecar.host.upload.storage_config import StorageConfig
from sidecar.host.upload.transfer import S3Destination
from sidecar.host.upload.uploader import Destination, Uploader, UploaderConfig

__all__ = ["ACCESS_KEY", "MIB", "SECRET_KEY", "S3Server", "isolate_aws_env", "make_checkpoint",
           "running_s3", "wait_for"]

MIB = 1 << 20
ACCESS_KEY = "AKIDUPLOADTEST0001"
# Distinctive, so a test can prove it appears in no log line, response or file.
SECRET_KEY = "s3cr3t-Upload-Key-7Qx9"


class S3Server:
    """moto's S3 server in a thread on 127.0.0.1; stop() really closes the socket, so a
    stopped server refuses connections (storage down), and start() can reopen the port."""

    def __init__(self) -> None:
        self.port = 0
        self._server: Optional[ThreadedMotoServer] = None

    def start(self) -> S3Server:
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self._server.start()
        self.port = self._server.get_host_and_port()[1]
        return self

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.stop()
            if server._server is not None:
                server._server.server_close()  # moto's stop() leaves the socket listening

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def storage(self, **overrides: Any) -> StorageConfig:
        values: dict[str, Any] = {
            "endpoint": self.endpoint, "access_key": ACCESS_KEY, "secret_key": SECRET_KEY,
            "part_size": 5 * MIB, "concurrency": 4, "max_attempts": 1,
            "connect_timeout": 2.0, "read_timeout": 10.0,
        }
        values.update(overrides)
        return StorageConfig(**values)

    def client(self) -> Any:
        return make_client(self.storage())

    def bucket(self, name: str) -> S3Location:
        self.client().create_bucket(Bucket=name)
        return S3Location(name, "run")

    def keys(self, location: S3Location) -> list[str]:
        client = self.client()
        keys: list[str] = []
        for page in client.get_paginator("list_objects_v2").paginate(
            Bucket=location.bucket, Prefix=location.listing_prefix
        ):
            keys += [item["Key"] for item in page.get("Contents", [])]
        return sorted(keys)

    def multipart_uploads(self, location: S3Location) -> list[dict[str, Any]]:
        response = self.client().list_multipart_uploads(Bucket=location.bucket)
        return list(response.get("Uploads", []))

    def get(self, location: S3Location, key: str) -> bytes:
        body: bytes = self.client().get_object(Bucket=location.bucket, Key=key)["Body"].read()
        return body


@contextmanager
def running_s3() -> Iterator[S3Server]:
    server = S3Server().start()
    try:
        yield server
    finally:
        server.stop()


def isolate_aws_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """boto3 must never look for credentials or regions on a real cloud, nor read the
    developer's own AWS configuration."""
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
                 "AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)


def make_checkpoint(root: Path, step: int, sizes: dict[str, int], *,
                    checksum: bool = True, keep_last: Optional[int] = None) -> CheckpointInfo:
    """A committed checkpoint whose files hold random bytes of the given sizes."""
    save = atomic_checkpoint(root, step, checksum=checksum, keep_last=keep_last)
    with save as folder:
        for relative, size in sizes.items():
            path = folder / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(os.urandom(size))
    assert save.info is not None
    return save.info


def commit_to_s3(s3: S3Server, location: S3Location, info: CheckpointInfo,
                 unchanged_since: Optional[str] = None) -> None:
    """Commit one local checkpoint to ``location`` the way the uploader does (every file,
    the size check, the manifest last), without an uploader around it; a file equal to
    one of the durable ``unchanged_since`` checkpoint by reference, as the uploader does."""
    destination = S3Destination(s3.storage(), location, make_client)
    durable = destination.durable_files(unchanged_since) if unchanged_since else {}
    destination.upload(info, (info.path / MANIFEST_NAME).read_bytes(),
                       on_progress=lambda count: None, should_stop=lambda: None,
                       before_manifest=lambda: None, durable=durable)


@contextmanager
def uploading(local: Path, destination: Destination) -> Iterator[Uploader]:
    """The real uploader from ``local`` to ``destination``, rescanning every 0.1 s."""
    config = UploaderConfig(root=local, location=None, scan_interval_seconds=0.1,
                            backoff_base_seconds=0.05, backoff_cap_seconds=0.4)
    uploader = Uploader(config, destination=destination)
    uploader.start()
    try:
        yield uploader
    finally:
        uploader.stop(timeout=5)


def record(uploader: Uploader, name: str) -> Optional[UploadRecord]:
    return uploader.tracker.get(name)


def state(uploader: Uploader, name: str) -> Optional[str]:
    found = record(uploader, name)
    return None if found is None else found.state
