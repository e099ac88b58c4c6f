"""The uploader inside the real daemon: GET /v1/uploads, /metrics, /healthz, the stdlib
client's durable-step question, secrets kept out of every output, boto3 left unloaded
when upload is off, and a daemon SIGKILLed mid-upload that finishes cleanly on restart.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import serve_daemon
from upload_support import (
    ACCESS_KEY,
    MIB,
    SECRET_KEY,
    S3Server,
    isolate_aws_env,
    make_checkpoint,
    wait_for,
)

from sidecar.checkpoint.folders import latest_valid
from sidecar.host.upload.location import S3Location
from sidecar.host.upload.restore import restore
from sidecar.host.upload.uploader import MARKER_NAME
from sidecar.host.upload.volume import EXIT_NOTHING, RestoreError
from sidecar.train.client import SidecarClient

STATIC = {"sources": ("static",), "expires_at": "2030-01-01T00:00:00Z"}
REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(autouse=True)
def _env(monkeypatch: pytest.MonkeyPatch) -> None:
    isolate_aws_env(monkeypatch)


def get(url: str) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            raw = response.read().decode()
            status = response.status
    except urllib.error.HTTPError as exc:
        raw, status = exc.read().decode(), exc.code
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw


def metric_samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text) for sample in family.samples
    }


def upload_settings(s3: S3Server, root: Path, location: S3Location, **extra: Any) -> dict[str, Any]:
    return {
        **STATIC,
        "upload_from": root,
        "upload_to": location.url,
        "upload_endpoint": s3.endpoint,
        "upload_access_key": ACCESS_KEY,
        "upload_secret_key": SECRET_KEY,
        "upload_part_size": 5 * MIB,
        "upload_scan_interval": 0.2,
        **extra,
    }


def test_daemon_serves_upload_status_metrics_and_the_client_sees_the_durable_step(
    s3: S3Server, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="sidecar")
    location = s3.bucket("daemon-status")
    info = make_checkpoint(tmp_path, 300, {"model.pt": 6 * MIB, "rng.json": 10})
    with serve_daemon(**upload_settings(s3, tmp_path, location)) as daemon:
        client = SidecarClient(daemon.url, timeout=5)

        def durable() -> Any:
            return client.last_durable_step()

        assert wait_for(durable, timeout=20) == 300
        assert client.is_durable(300) is True and client.is_durable(301) is False
        status, body = get(daemon.url + "/v1/uploads")
        assert status == 200 and body["enabled"] is True
        assert body["destination"] == location.url and body["status"] == "ok"
        assert body["last_durable_step"] == 300 and body["last_durable_name"] == info.name
        (entry,) = body["checkpoints"]
        assert entry["state"] == "done" and entry["step"] == 300
        assert entry["bytes_done"] == entry["bytes_total"] == info.total_bytes
        assert entry["duration_seconds"] >= 0 and entry["error"] is None
        assert get(daemon.url + "/v1/uploads?limit=0")[1]["checkpoints"] == []
        status, health = get(daemon.url + "/healthz")
        assert status == 200 and health["uploads"]["last_durable_step"] == 300
        _, metrics = get(daemon.url + "/metrics")
        samples = metric_samples(metrics)
        assert samples[("esi_sidecar_upload_last_durable_step", ())] == 300
        assert samples[("esi_sidecar_upload_bytes_total", ())] == info.total_bytes
        assert samples[("esi_sidecar_upload_completed_total", ())] == 1
        assert samples[("esi_sidecar_upload_failures_total", ())] == 0
        assert samples[("esi_sidecar_upload_duration_seconds_count", ())] == 1
        assert samples[("esi_sidecar_upload_checkpoints", (("state", "done"),))] == 1
        assert samples[("esi_sidecar_upload_last_durable_timestamp_seconds", ())] > 1.7e9
        outputs = [json.dumps(body), json.dumps(health), metrics,
                   json.dumps(get(daemon.url + "/openapi.json")[1]), repr(daemon.settings)]
    for text in [*outputs, caplog.text]:
        assert SECRET_KEY not in text


def test_storage_down_is_degraded_in_uploads_but_healthz_stays_200(
    tmp_path: Path, unused_port: int
) -> None:
    make_checkpoint(tmp_path, 1, {"w.bin": 10})
    dead = S3Location("nowhere", "run")
    settings = {**STATIC, "upload_from": tmp_path, "upload_to": dead.url,
                "upload_endpoint": f"http://127.0.0.1:{unused_port}",
                "upload_access_key": ACCESS_KEY, "upload_secret_key": SECRET_KEY}
    with serve_daemon(**settings) as daemon:
        wait_for(lambda: get(daemon.url + "/v1/uploads")[1]["degraded"], timeout=20)
        _, body = get(daemon.url + "/v1/uploads")
        assert body["status"] == "degraded"
        assert "cannot reach the storage endpoint" in body["error"]
        assert body["last_durable_step"] is None
        status, health = get(daemon.url + "/healthz")
        assert status == 200 and health["status"] == "ok"
        assert health["uploads"]["degraded"] is True
        client = SidecarClient(daemon.url, timeout=5)
        assert client.last_durable_step() is None and client.is_durable(1) is False
        assert metric_samples(get(daemon.url + "/metrics")[1])[
            ("esi_sidecar_upload_degraded", ())] == 1
    assert (tmp_path / "step_00000001").is_dir()  # nothing deleted locally


def test_without_upload_settings_nothing_of_boto3_is_loaded(tmp_path: Path) -> None:
    code = textwrap.dedent("""
        import sys
        from sidecar.host.settings import Settings
        from sidecar.host.daemon import build_daemon
        build_daemon(Settings(sources=("static",), expires_at="2030-01-01T00:00:00Z"))
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in
                        ("boto3", "botocore", "s3transfer", "watchdog")
                        or m.startswith("sidecar.host.upload"))
        print(",".join(loaded))
    """)
    # Of the upload package, only its pure plan (the upload settings' defaults live there).
    pure = "sidecar.host.upload,sidecar.host.upload.plan"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=REPO, check=True, timeout=60)
    assert result.stdout.strip() == pure
    with serve_daemon(**STATIC) as daemon:
        status, body = get(daemon.url + "/v1/uploads")
        assert status == 200 and body["enabled"] is False and body["last_durable_step"] is None
        client = SidecarClient(daemon.url, timeout=5)
        assert client.last_durable_step() is None and client.is_durable(1) is None
        assert client.last_error is None
        assert "uploads" not in get(daemon.url + "/healthz")[1]


# A daemon that stops dead inside the upload: one transfer at a time, so once 6 MiB have
# been sent, part 1 (5 MiB) has its answer and part 2 is on its way; the hook signals and
# blocks there, and the test kills the process.
_KILLED_DAEMON = textwrap.dedent("""
    import sys, threading
    from pathlib import Path
    import sidecar.host.upload.transfer as transfer
    flag = Path(sys.argv[1])
    def hook(phase, detail):
        if phase == "progress" and detail > 6 * 1024 * 1024:
            flag.write_text("first part uploaded")
            threading.Event().wait()
    transfer._phase_hook = hook
    from sidecar.cli import main
    sys.exit(main(sys.argv[2:]))
""")


def test_daemon_killed_mid_upload_restarts_cleanly(s3: S3Server, tmp_path: Path) -> None:
    location = s3.bucket("killed-mid-upload")
    root = tmp_path / "ckpt"
    info = make_checkpoint(root, 500, {"model.pt": 12 * MIB, "optim.pt": 3000})
    flag = tmp_path / "flag"
    log_path = tmp_path / "daemon.log"
    env = {**os.environ, "ESI_SIDECAR_UPLOAD_ACCESS_KEY": ACCESS_KEY,
           "ESI_SIDECAR_UPLOAD_SECRET_KEY": SECRET_KEY, "AWS_EC2_METADATA_DISABLED": "true"}
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-c", _KILLED_DAEMON, str(flag), "serve", "--source", "static",
             "--expires-at", "2030-01-01T00:00:00Z", "--listen", "127.0.0.1:0",
             "--upload-from", str(root), "--upload-to", location.url,
             "--upload-endpoint", s3.endpoint, "--upload-part-size", "5MiB",
             "--upload-concurrency", "1", "--log-level", "DEBUG"],
            env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
        )
        try:
            wait_for(lambda: flag.exists() or process.poll() is not None, timeout=30)
            assert process.poll() is None, log_path.read_text()[-3000:]
            # Mid-upload: a multipart upload with a finished part, and no manifest.
            (upload,) = [u for u in s3.multipart_uploads(location)
                         if u["Key"] == location.key(info.name, "model.pt")]
            parts = s3.client().list_parts(Bucket=location.bucket, Key=upload["Key"],
                                           UploadId=upload["UploadId"])
            assert len(parts.get("Parts", [])) >= 1
            process.send_signal(signal.SIGKILL)
            process.wait(10)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait(10)
    assert location.manifest_key(info.name) not in s3.keys(location)
    assert (info.path / MARKER_NAME).exists()  # the killed daemon's pin is still there
    with pytest.raises(RestoreError) as nothing:  # nothing partial is taken for complete
        restore(s3.storage(), location, tmp_path / "too-early")
    assert nothing.value.exit_code == EXIT_NOTHING
    assert SECRET_KEY not in log_path.read_text()

    with serve_daemon(**upload_settings(s3, root, location)) as daemon:
        client = SidecarClient(daemon.url, timeout=5)
        assert wait_for(client.last_durable_step, timeout=30) == 500
    assert s3.multipart_uploads(location) == []  # the killed run's upload was aborted
    assert not (info.path / MARKER_NAME).exists()
    restored = restore(s3.storage(), location, tmp_path / "fresh")
    assert restored.info.step == 500
    for entry in info.files:
        assert (restored.info.path / entry.path).read_bytes() == (
            info.path / entry.path).read_bytes()
    assert latest_valid(tmp_path / "fresh", verify_checksums=True).step == 500  # type: ignore[union-attr]
