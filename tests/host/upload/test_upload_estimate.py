"""The upload estimate the real daemon serves (``/v1/expiry``'s ``upload_seconds``): an
upload in progress that is slower than the estimate assumed raises it before it ends, so
a link that slows is seen before the final save (issue 23, item 3)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import get_json, serve_daemon, wait_for

from sidecar.checkpoint.folders import atomic_checkpoint
from sidecar.train.client import SidecarClient

MIB = 1 << 20


def saved_elsewhere(elsewhere: Path, root: Path, step: int, size: int) -> None:
    """A complete checkpoint appears in ``root`` at once (saved in ``elsewhere``, moved
    in), so the daemon sends it whole after the save, none of it while it was written."""
    with atomic_checkpoint(elsewhere, step) as folder:
        (folder / "model.pt").write_bytes(os.urandom(size))
    name = f"step_{step:08d}"
    os.rename(elsewhere / name, root / name)


@contextmanager
def volume_daemon(tmp_path: Path, *, size: int, release_in: float,
                  bandwidth: int) -> Iterator[tuple[Any, Path, Path, Path]]:
    """A daemon uploading to a volume capped at ``bandwidth``, the release ``release_in``
    seconds away, with a first checkpoint of ``size`` bytes: (daemon, local, volume,
    elsewhere)."""
    local, volume, elsewhere = tmp_path / "local", tmp_path / "volume", tmp_path / "elsewhere"
    for folder in (local, volume, elsewhere):
        folder.mkdir()
    saved_elsewhere(elsewhere, local, 1, size)
    settings = {"sources": ("static",), "expires_at": str(time.time() + release_in),
                "upload_from": local, "upload_to": volume.as_uri(),
                "upload_scan_interval": 0.2, "upload_max_bandwidth": bandwidth}
    with serve_daemon(**settings) as daemon:
        yield daemon, local, volume, elsewhere


def expiry(daemon: Any) -> Any:
    return get_json(daemon.url + "/v1/expiry")[1]


def test_a_slow_upload_raises_the_served_estimate_while_it_runs(tmp_path: Path) -> None:
    with volume_daemon(tmp_path, size=4 * MIB, release_in=3600,
                       bandwidth=16 * MIB) as (daemon, local, _, elsewhere):
        client = SidecarClient(daemon.url, timeout=5)
        wait_for(lambda: client.last_durable_step() == 1, timeout=30)
        before = expiry(daemon)["upload_seconds"]
        assert before is not None and 4 / 16 * 1.2 <= before < 3.0, before
        # The link slows to 1 MiB/s (the volume's paced copy, the cap a link would be):
        # the next checkpoint, the same 4 MiB, takes about 4 s instead of 0.25 s.
        daemon.daemon.uploader.destination.max_bandwidth = 1 * MIB
        saved_elsewhere(elsewhere, local, 2, 4 * MIB)
        wait_for(lambda: expiry(daemon)["upload_status"] == "uploading", timeout=10)
        risen = wait_for(lambda: (lambda e: e["upload_seconds"] > 2 * before and e)(expiry(daemon)),
                         timeout=10)
        # Seen while the slow upload runs, before it ends.
        assert risen["upload_status"] == "uploading"
        assert client.last_durable_step() == 1
        wait_for(lambda: client.last_durable_step() == 2, timeout=30)
        after = expiry(daemon)["upload_seconds"]
        # Measured: the slow one is the tail now, 4 MiB at about 1 MiB/s, with the margin.
        assert after >= 4 * 1.2 * 0.8 and after > risen["upload_seconds"], (after, risen)


# Two probes of seconds each at the throttled speed: about 18 s, so out of the fast tier.
@pytest.mark.slow
def test_a_link_that_slows_while_idle_is_seen_by_the_probe(
        tmp_path: Path, monkeypatch: Any) -> None:
    """No upload runs after the link slows: the probes (two agreeing) raise the estimate,
    and leave nothing on the volume."""
    from sidecar.host.upload import plan

    monkeypatch.setattr(plan, "PROBE_NEAR_SECONDS", 0.5)  # near the release: every 0.5 s
    with volume_daemon(tmp_path, size=16 * MIB, release_in=300,
                       bandwidth=64 * MIB) as (daemon, _, volume, _):
        client = SidecarClient(daemon.url, timeout=5)
        wait_for(lambda: client.last_durable_step() == 1, timeout=30)
        wait_for(lambda: get_json(daemon.url + "/v1/uploads")[1]["last_probe"] is not None,
                 timeout=10)
        before = expiry(daemon)["upload_seconds"]
        assert before is not None and before < 16 / 64 * 1.2 * 3, before
        # The link slows 4x: each probe (2 s at the assumed 64 MiB/s) now takes about 8 s.
        daemon.daemon.uploader.destination.max_bandwidth = 16 * MIB
        risen = wait_for(
            lambda: (lambda e: e["upload_seconds"] > 2.5 * before and e)(expiry(daemon)),
            timeout=60)
        # The probed duration: 16 MiB at about 16 MiB/s.
        assert 0.8 <= risen["upload_seconds"] <= 2, risen
        probe = get_json(daemon.url + "/v1/uploads")[1]["last_probe"]
        assert probe["bytes"] >= 8 * MIB and probe["seconds"] > 0
        assert sorted(p.name for p in volume.iterdir()
                      if not p.name.startswith(".")) == ["step_00000001"]
        assert not [p for p in volume.iterdir() if "probe" in p.name]
