"""Restore from a real S3-protocol server on loopback: only complete remote checkpoints
(manifest present) are taken, files are verified, the local commit is atomic, and the
command's errors are one clear line with a useful exit code."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from upload_support import (
    ACCESS_KEY,
    MIB,
    SECRET_KEY,
    S3Server,
    commit_to_s3,
    isolate_aws_env,
    make_checkpoint,
)

from sidecar.checkpoint.folders import LATEST_NAME, latest_valid
from sidecar.cli import main
from sidecar.host.upload.location import S3Location
from sidecar.host.upload.restore import restore
from sidecar.host.upload.volume import EXIT_NOTHING, RestoreError


@pytest.fixture(autouse=True)
def _env(monkeypatch: pytest.MonkeyPatch) -> None:
    isolate_aws_env(monkeypatch)


def upload(s3: S3Server, location: S3Location, root: Path, step: int,
           sizes: dict[str, int]) -> Path:
    """Commit a checkpoint locally and upload it the way the uploader does."""
    info = make_checkpoint(root, step, sizes)
    commit_to_s3(s3, location, info)
    return info.path


def same_tree(left: Path, right: Path) -> bool:
    def files(root: Path) -> dict[str, bytes]:
        return {p.relative_to(root).as_posix(): p.read_bytes()
                for p in sorted(root.rglob("*")) if p.is_file()}
    return files(left) == files(right)


def test_round_trip_restores_the_newest_complete_checkpoint(
    s3: S3Server, bucket: S3Location, tmp_path: Path
) -> None:
    source = tmp_path / "source"
    upload(s3, bucket, source, 100, {"a.bin": 10})
    newest = upload(s3, bucket, source, 200, {"model.pt": 11 * MIB, "dcp/shard_0.distcp": 3000,
                                               "dcp/.metadata": 50})
    target = tmp_path / "fresh"
    restored = restore(s3.storage(), bucket, target)
    assert restored.info.name == "step_00000200" and not restored.already_present
    assert same_tree(newest, target / "step_00000200")
    found = latest_valid(target, verify_checksums=True)
    assert found is not None and found.step == 200
    assert (target / LATEST_NAME).read_text().strip() == "step_00000200"
    assert [p.name for p in target.iterdir() if p.name.startswith(".")] == []
    again = restore(s3.storage(), bucket, target)  # idempotent
    assert again.already_present and again.info.step == 200


def test_a_folder_without_manifest_is_never_taken_for_a_checkpoint(
    s3: S3Server, bucket: S3Location, tmp_path: Path
) -> None:
    complete = upload(s3, bucket, tmp_path / "source", 1, {"w.bin": 100})
    # A newer upload that was killed before its manifest: files only.
    client = s3.client()
    client.put_object(Bucket=bucket.bucket, Key=bucket.key("step_00000002", "w.bin"),
                      Body=b"partial")
    restored = restore(s3.storage(), bucket, tmp_path / "fresh")
    assert restored.info.step == 1
    assert same_tree(complete, tmp_path / "fresh" / "step_00000001")
    assert not (tmp_path / "fresh" / "step_00000002").exists()


def test_only_partial_uploads_means_nothing_to_restore(
    s3: S3Server, bucket: S3Location, tmp_path: Path
) -> None:
    s3.client().put_object(Bucket=bucket.bucket, Key=bucket.key("step_00000005", "w.bin"),
                           Body=b"partial")
    with pytest.raises(RestoreError) as caught:
        restore(s3.storage(), bucket, tmp_path / "fresh")
    assert caught.value.exit_code == EXIT_NOTHING
    assert "no complete checkpoint" in str(caught.value)
    assert "1 folder(s) without a manifest" in str(caught.value)
    assert latest_valid(tmp_path / "fresh") is None


def test_restore_a_chosen_step(s3: S3Server, bucket: S3Location, tmp_path: Path) -> None:
    older = upload(s3, bucket, tmp_path / "source", 10, {"w.bin": 10})
    upload(s3, bucket, tmp_path / "source", 20, {"w.bin": 20})
    restored = restore(s3.storage(), bucket, tmp_path / "fresh", step=10)
    assert restored.info.step == 10 and same_tree(older, restored.info.path)
    with pytest.raises(RestoreError, match="no complete checkpoint at step 15"):
        restore(s3.storage(), bucket, tmp_path / "other", step=15)


def test_a_corrupt_remote_file_fails_the_restore_and_leaves_nothing(
    s3: S3Server, bucket: S3Location, tmp_path: Path
) -> None:
    path = upload(s3, bucket, tmp_path / "source", 3, {"w.bin": 1000})
    key = bucket.key(path.name, "w.bin")
    s3.client().put_object(Bucket=bucket.bucket, Key=key, Body=os.urandom(1000))  # same size
    target = tmp_path / "fresh"
    with pytest.raises(RestoreError, match="does not match its sha256"):
        restore(s3.storage(), bucket, target)
    assert latest_valid(target) is None
    assert list(target.iterdir()) == []  # no folder, no leftover
    s3.client().put_object(Bucket=bucket.bucket, Key=key, Body=b"short")
    with pytest.raises(RestoreError, match="is 5 bytes, the manifest says 1000"):
        restore(s3.storage(), bucket, target)


# ---------------------------------------------------------------------- the command


def run_cli(monkeypatch: pytest.MonkeyPatch, *args: str) -> int:
    monkeypatch.setenv("ESI_SIDECAR_UPLOAD_ACCESS_KEY", ACCESS_KEY)
    monkeypatch.setenv("ESI_SIDECAR_UPLOAD_SECRET_KEY", SECRET_KEY)
    return main(["restore", *args])


def test_cli_restores_and_prints_one_line(
    s3: S3Server, bucket: S3Location, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    upload(s3, bucket, tmp_path / "source", 42, {"w.bin": 6 * MIB})
    code = run_cli(monkeypatch, "--from", bucket.url, "--to", str(tmp_path / "fresh"),
                   "--endpoint", s3.endpoint)
    out, err = capsys.readouterr()
    assert code == 0, err
    assert out.startswith("restored step_00000042 (step 42, ") and err == ""
    assert latest_valid(tmp_path / "fresh").step == 42  # type: ignore[union-attr]
    # The daemon's variables work as defaults, so one env file serves both.
    monkeypatch.setenv("ESI_SIDECAR_UPLOAD_TO", bucket.url)
    monkeypatch.setenv("ESI_SIDECAR_UPLOAD_FROM", str(tmp_path / "fresh"))
    monkeypatch.setenv("ESI_SIDECAR_UPLOAD_ENDPOINT", s3.endpoint)
    assert run_cli(monkeypatch) == 0
    assert "already the newest complete checkpoint" in capsys.readouterr().out


def test_cli_exit_3_when_there_is_nothing(
    s3: S3Server, bucket: S3Location, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = run_cli(monkeypatch, "--from", bucket.url, "--to", str(tmp_path),
                   "--endpoint", s3.endpoint)
    assert code == 3
    assert "no complete checkpoint under s3://" in capsys.readouterr().err


def test_cli_clear_errors(
    s3: S3Server, bucket: S3Location, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str], unused_port: int,
) -> None:
    # Endpoint unreachable.
    code = run_cli(monkeypatch, "--from", bucket.url, "--to", str(tmp_path),
                   "--endpoint", f"http://127.0.0.1:{unused_port}")
    err = capsys.readouterr().err
    assert code == 1 and "cannot reach the storage endpoint" in err
    # No such bucket.
    code = run_cli(monkeypatch, "--from", "s3://no-such-bucket-here/x", "--to", str(tmp_path),
                   "--endpoint", s3.endpoint)
    err = capsys.readouterr().err
    assert code == 1 and "bucket does not exist" in err
    # Access denied: moto checks credentials once told to; ours are unknown to it.
    import urllib.request

    def set_auth(count: str) -> None:
        request = urllib.request.Request(f"{s3.endpoint}/moto-api/reset-auth",
                                         data=count.encode(), method="POST",
                                         headers={"Content-Type": "text/plain"})
        urllib.request.urlopen(request, timeout=5).read()

    set_auth("0")
    try:
        code = run_cli(monkeypatch, "--from", bucket.url, "--to", str(tmp_path),
                       "--endpoint", s3.endpoint)
    finally:
        set_auth("inf")
    err = capsys.readouterr().err
    assert code == 1 and "access denied" in err
    # Usage errors.
    assert run_cli(monkeypatch, "--from", "http://x", "--to", str(tmp_path)) == 2
    assert run_cli(monkeypatch, "--to", str(tmp_path)) == 2
    for text in capsys.readouterr():
        assert SECRET_KEY not in text
