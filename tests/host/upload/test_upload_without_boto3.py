"""A mounted volume needs no boto3 (issue 39, item 9): ``serve --upload-to file://...`` and
``restore --from file://...`` run where boto3, botocore and s3transfer cannot be imported,
as on a ``[server]``-only install. The daemon and the restore are real processes; only the
three packages are made unimportable, in those processes alone."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from daemon_harness import fetch_json, wait_for

from sidecar.checkpoint.folders import atomic_checkpoint, latest_valid

REPO = Path(__file__).resolve().parents[3]
# ``sys.modules[name] = None`` makes ``import name`` (and its submodules) raise ImportError.
WITHOUT_BOTO3 = (
    "import sys\n"
    "for name in ('boto3', 'botocore', 's3transfer'):\n"
    "    sys.modules[name] = None\n"
    "from sidecar.cli import main\n"
    "sys.exit(main())\n"
)
SERVING = re.compile(r"serving on 127\.0\.0\.1:(\d+)")


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if not k.startswith("ESI_SIDECAR_") and k != "STATE_DIRECTORY"}


def _port(log: Path) -> int | None:
    found = SERVING.search(log.read_text(errors="replace"))
    return int(found.group(1)) if found else None


def _durable_step(url: str) -> int | None:
    answer = fetch_json(url + "/v1/uploads")
    return answer[1].get("last_durable_step") if answer and answer[0] == 200 else None


def test_a_volume_upload_and_its_restore_run_without_boto3(tmp_path: Path) -> None:
    local, volume, fresh = tmp_path / "ckpt", tmp_path / "volume", tmp_path / "fresh"
    local.mkdir()
    volume.mkdir()
    log_path = tmp_path / "daemon.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-c", WITHOUT_BOTO3, "serve", "--source", "static",
             "--expires-at", "2030-01-01T00:00:00Z", "--listen", "127.0.0.1:0",
             "--upload-from", str(local), "--upload-to", f"file://{volume}"],
            env=_env(), stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        try:
            port = wait_for(lambda: _port(log_path) or process.poll() is not None, timeout=30)
            assert process.poll() is None, log_path.read_text()[-3000:]
            with atomic_checkpoint(local, 7) as folder:
                (folder / "model.pt").write_bytes(b"weights" * 1000)
            url = f"http://127.0.0.1:{port}"
            assert wait_for(lambda: _durable_step(url), timeout=30) == 7, (
                log_path.read_text()[-3000:])
        finally:
            process.kill()
            process.wait(10)
    assert latest_valid(volume, verify_checksums=True).step == 7  # type: ignore[union-attr]
    assert "Traceback" not in log_path.read_text()

    restored = subprocess.run(
        [sys.executable, "-c", WITHOUT_BOTO3, "restore", "--from", f"file://{volume}",
         "--to", str(fresh)],
        env=_env(), capture_output=True, text=True, cwd=REPO, timeout=60)
    assert restored.returncode == 0, restored.stderr[-3000:]
    found = latest_valid(fresh, verify_checksums=True)
    assert found is not None and found.step == 7
    assert (found.path / "model.pt").read_bytes() == b"weights" * 1000
