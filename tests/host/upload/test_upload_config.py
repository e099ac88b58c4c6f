"""Upload settings: the s3:// URL, sizes, the secret kept out of flags and messages, and
the storage client's choices (addressing style, TOS region) made without a request."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sidecar.host.settings import OPTIONS, ConfigError, add_arguments, load_settings
from sidecar.host.upload.location import S3Location, parse_s3_url

SECRET = "s3cr3t-Config-Value-99"


def test_s3_url_parsing_and_key_layout() -> None:
    location = parse_s3_url("s3://my-bucket/runs/42/")
    assert location == S3Location("my-bucket", "runs/42")
    assert location.url == "s3://my-bucket/runs/42"
    assert location.key("step_00000100", "dcp/shard_0") == "runs/42/step_00000100/dcp/shard_0"
    assert location.manifest_key("step_00000100") == "runs/42/step_00000100/MANIFEST.json"
    top = parse_s3_url("s3://my-bucket")
    assert top.listing_prefix == "" and top.folder("a") == "a/"
    for bad in ("my-bucket/x", "https://my-bucket/x", "s3://B_AD/x", "s3://ab/x",
                "s3://my-bucket/a//b", "s3://my-bucket/a/../b"):
        with pytest.raises(ValueError):
            parse_s3_url(bad)


def test_upload_settings_from_flags_and_environment() -> None:
    settings = load_settings(
        {"upload_from": "/ckpt", "upload_to": "s3://bkt/run", "upload_part_size": "8MiB"},
        environ={"ESI_SIDECAR_UPLOAD_CONCURRENCY": "16",
                 "ESI_SIDECAR_UPLOAD_ENDPOINT": "https://tos-s3-cn-beijing.volces.com/",
                 "ESI_SIDECAR_UPLOAD_ACCESS_KEY": "AKLTexample",
                 "ESI_SIDECAR_UPLOAD_SECRET_KEY": SECRET},
    )
    assert settings.upload_to == "s3://bkt/run" and str(settings.upload_from) == "/ckpt"
    assert settings.upload_part_size == 8 << 20 and settings.upload_concurrency == 16
    assert settings.upload_endpoint == "https://tos-s3-cn-beijing.volces.com"
    assert settings.upload_secret_key == SECRET and SECRET not in repr(settings)
    assert load_settings({}, environ={}).upload_to is None  # off by default


@pytest.mark.parametrize(("given", "environ", "message"), [
    ({"upload_to": "s3://bkt/run"}, {}, "needs both --upload-from"),
    ({"upload_from": "/x"}, {}, "needs both --upload-from"),
    ({"upload_part_size": "4MiB"}, {}, "between 5MiB and 5GiB"),
    ({"upload_part_size": "lots"}, {}, "expected a size"),
    ({"upload_concurrency": "0"}, {}, "integer >= 1"),
    ({"upload_addressing_style": "sideways"}, {}, "auto, path or virtual"),
    ({}, {"ESI_SIDECAR_UPLOAD_ACCESS_KEY": "AK"}, "set both ESI_SIDECAR_UPLOAD_ACCESS_KEY"),
    ({}, {"ESI_SIDECAR_UPLOAD_SECRET_KEY": " "}, None),  # empty: not set
])
def test_bad_upload_settings_stop_start_up(
    given: dict[str, str], environ: dict[str, str], message: str | None
) -> None:
    if message is None:
        assert load_settings(given, environ=environ).upload_secret_key is None
        return
    with pytest.raises(ConfigError, match=message):
        load_settings(given, environ=environ)


def test_secrets_have_no_flag_and_never_appear_in_errors() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    flags = {action.dest for action in parser._actions}
    assert "upload_secret_key" not in flags and "upload_access_key" not in flags
    assert "upload_to" in flags
    secret_rows = [option for option in OPTIONS if option.env_only]
    assert {option.env for option in secret_rows} == {
        "ESI_SIDECAR_UPLOAD_ACCESS_KEY", "ESI_SIDECAR_UPLOAD_SECRET_KEY", "ESI_SIDECAR_TOKEN"}
    with pytest.raises(ConfigError) as caught:
        load_settings({}, environ={"ESI_SIDECAR_UPLOAD_SECRET_KEY": SECRET})
    assert SECRET not in str(caught.value)


def test_storage_choices_without_a_request(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("boto3")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.delenv("AWS_REGION", raising=False)
    monkeypatch.delenv("AWS_DEFAULT_REGION", raising=False)
    from sidecar.host.upload.storage import _addressing_style, make_client, region_for
    from sidecar.host.upload.storage_config import StorageConfig

    tos = StorageConfig(endpoint="https://tos-s3-cn-beijing.volces.com")
    assert region_for(tos) == "cn-beijing" and _addressing_style(tos) == "virtual"
    assert region_for(StorageConfig(endpoint="https://tos-s3-cn-shanghai.ivolces.com")) == (
        "cn-shanghai")
    loopback = StorageConfig(endpoint="http://127.0.0.1:9000")
    assert _addressing_style(loopback) == "path"
    assert _addressing_style(StorageConfig(endpoint="http://localhost:9000")) == "path"
    assert _addressing_style(StorageConfig(endpoint="http://minio:9000",
                                           addressing_style="path")) == "path"
    client = make_client(StorageConfig(endpoint="https://tos-s3-cn-beijing.volces.com",
                                       access_key="AK", secret_key=SECRET))
    assert client.meta.region_name == "cn-beijing"
    assert SECRET not in repr(StorageConfig(access_key="AK", secret_key=SECRET))


def test_upload_settings_without_the_upload_extra_stop_start_up_with_one_line(
    tmp_path: Path,
) -> None:
    """A [server]-only install (or image) given --upload-to: one line naming the extra, not
    a ModuleNotFoundError traceback. boto3 is made unimportable in that process only."""
    script = (
        "import sys; sys.modules['boto3'] = None; sys.modules['botocore'] = None\n"
        "from sidecar.cli import main; sys.exit(main())\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("ESI_SIDECAR_")}
    result = subprocess.run(
        [sys.executable, "-c", script, "serve", "--source", "static",
         "--expires-at", "2030-01-01T00:00:00Z", "--listen", "127.0.0.1:0",
         "--upload-from", str(tmp_path), "--upload-to", "s3://bucket/prefix"],
        env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if "esi-sidecar serve:" in line]
    assert errors == ["esi-sidecar serve: --upload-to s3:// needs the [upload] extra (boto3 is "
                      "not installed): pip install 'esi-sidecar[server,upload]', install.sh "
                      "--upload, or the image built with --build-arg UPLOAD=1"], result.stderr
    assert "Traceback" not in result.stderr
