"""The link probe against the real S3-protocol server (moto over HTTP, real boto3) and a
volume: it goes at the uploads' cap and leaves nothing a listing, restore or retention
could see (``sidecar.host.upload.probe``)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from upload_support import MIB, S3Server, isolate_aws_env

from sidecar.host.upload.identity import VOLUME_MARKER
from sidecar.host.upload.storage import make_client
from sidecar.host.upload.transfer import Cancelled, S3Destination, list_remote_names
from sidecar.host.upload.volume import VolumeDestination


@pytest.fixture(autouse=True)
def _env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    isolate_aws_env(monkeypatch)
    yield


def test_an_s3_probe_is_paced_by_the_cap_and_leaves_nothing(s3: S3Server, bucket: Any) -> None:
    destination = S3Destination(s3.storage(max_bandwidth=8 * MIB), bucket, make_client)
    started = time.monotonic()
    destination.probe(16 * MIB, lambda: None)
    seconds = time.monotonic() - started
    assert seconds >= 16 / 8 * 0.6, seconds  # the throttle paces it as it paces uploads
    assert s3.keys(bucket) == []
    assert s3.multipart_uploads(bucket) == []  # aborted, never completed
    assert list_remote_names(destination.client(), bucket) == []


def test_an_s3_probe_stopped_midway_is_aborted(s3: S3Server, bucket: Any) -> None:
    destination = S3Destination(s3.storage(max_bandwidth=8 * MIB), bucket, make_client)
    calls = []

    def stop() -> Any:
        calls.append(1)
        return "stopping" if len(calls) > 1 else None

    with pytest.raises(Cancelled):
        destination.probe(64 * MIB, stop)
    assert s3.keys(bucket) == [] and s3.multipart_uploads(bucket) == []


def test_a_volume_probe_leaves_nothing(tmp_path: Path) -> None:
    volume = tmp_path / "volume"
    volume.mkdir()
    destination = VolumeDestination(volume, max_bandwidth=32 * MIB)
    destination.prepare(time.time())
    started = time.monotonic()
    destination.probe(16 * MIB, lambda: None)
    assert time.monotonic() - started >= 16 / 32 * 0.6
    assert [p.name for p in volume.iterdir()] == [VOLUME_MARKER]  # its identity only
