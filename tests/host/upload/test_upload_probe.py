"""The link probe against the real S3-protocol server (moto over HTTP, real boto3) and a
volume: it goes at the uploads' cap and leaves nothing a listing, restore or retention
could see (``sidecar.host.upload.probe``)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from upload_support import MIB, S3Server, isolate_aws_env, make_checkpoint, wait_for

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


def test_a_probe_gives_way_at_once_to_a_new_checkpoint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from sidecar.host.upload import plan
    from sidecar.host.upload.uploader import Uploader, UploaderConfig

    monkeypatch.setattr(plan, "PROBE_NEAR_SECONDS", 0.2)
    local, volume = tmp_path / "local", tmp_path / "volume"
    local.mkdir()
    volume.mkdir()
    destination = VolumeDestination(volume, max_bandwidth=1 * MIB)  # a probe: 8 s or more
    probing, outcomes = threading.Event(), []
    real_probe = destination.probe

    def probe(amount: int, should_stop: Any) -> None:
        probing.set()
        try:
            real_probe(amount, should_stop)
        except BaseException as exc:
            outcomes.append(type(exc).__name__)
            raise
        outcomes.append("done")

    destination.probe = probe  # type: ignore[method-assign]
    uploader = Uploader(UploaderConfig(root=local, location=None, scan_interval_seconds=0.2),
                        remaining_seconds=lambda: 100.0, destination=destination)
    uploader.start()
    try:
        make_checkpoint(local, 1, {"model.pt": 64 << 10})
        wait_for(lambda: uploader.tracker.last_durable() is not None, timeout=30)
        assert probing.wait(30)
        make_checkpoint(local, 2, {"model.pt": 64 << 10})
        wait_for(lambda: getattr(uploader.tracker.last_durable(), "step", None) == 2, timeout=30)
        assert outcomes[0] == "Cancelled", outcomes  # stopped for step 2, not finished
        assert uploader.tracker.last_probe() is None  # a stopped probe measures nothing
    finally:
        uploader.stop()
