"""No credentials in the daemon's log, even at DEBUG, where the SDKs log what they send.

The real daemon (``esi-sidecar serve --log-level DEBUG``, a process) polls the Volcengine
emulator through the real SDK with a known access key, secret and session token, and
uploads a checkpoint to moto's S3 server through boto3 with AWS credentials of its own:
its whole log holds none of them, nor a signature, nor an Authorization header's value.
"""

from __future__ import annotations

import io
import logging
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import fetch_json, wait_for

from sidecar.host import logscrub
from sidecar.tools.emulator import Emulator

VOLC_AK = "AKLTscrubtest0000000001"
VOLC_SK = "volc-Scrub-Secret-4Kq8"
VOLC_TOKEN = "volc-Scrub-Session-Token-9Zr2"
AWS_AK = "AKIASCRUBTEST0000001"
AWS_SK = "aws-Scrub-Secret-Key-3Tn7"
AWS_TOKEN = "aws-Scrub-Session-Token-6Wm1"
SECRETS = (VOLC_AK, VOLC_SK, VOLC_TOKEN, AWS_AK, AWS_SK, AWS_TOKEN)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def emulator() -> Iterator[tuple[Emulator, list[Mapping[str, str]]]]:
    """The Volcengine emulator, keeping the headers of every OpenAPI request it gets."""
    seen: list[Mapping[str, str]] = []
    with Emulator(access_key=VOLC_AK, secret_key=VOLC_SK, session_token=VOLC_TOKEN,
                  auto_release_at="2030-01-01T08:00:00+08:00") as emu:
        answer = emu.answer_api

        def recording(method: str, query: str, headers: Mapping[str, str], body: bytes) -> Any:
            seen.append(dict(headers))
            return answer(method, query, headers, body)

        emu.answer_api = recording  # type: ignore[method-assign]
        yield emu, seen


def test_the_daemon_at_debug_logs_no_credential_signature_or_authorization(
    emulator: tuple[Emulator, list[Mapping[str, str]]], s3: Any, tmp_path: Path
) -> None:
    from upload_support import make_checkpoint

    emu, seen = emulator
    location = s3.bucket("scrub-at-debug")
    root = tmp_path / "checkpoints"
    root.mkdir()
    make_checkpoint(root, 7, {"model.pt": 1024})
    port = free_port()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "VOLCENGINE_"))},
        "VOLCENGINE_ACCESS_KEY": VOLC_AK, "VOLCENGINE_SECRET_KEY": VOLC_SK,
        "VOLCENGINE_SESSION_TOKEN": VOLC_TOKEN, "VOLCENGINE_ECS_METADATA_DISABLED": "true",
        "VOLCENGINE_CLI_CONFIG_FILE": str(tmp_path / "absent.json"),
        # boto3's own chain, session token included (X-Amz-Security-Token on every request)
        "AWS_ACCESS_KEY_ID": AWS_AK, "AWS_SECRET_ACCESS_KEY": AWS_SK,
        "AWS_SESSION_TOKEN": AWS_TOKEN, "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    }
    log_path = tmp_path / "daemon.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "sidecar.cli", "serve", "--log-level", "DEBUG",
             "--listen", f"127.0.0.1:{port}", "--source", "volcengine-esi",
             "--api-endpoint", emu.url, "--metadata-url", emu.url, "--poll-interval", "0.5",
             "--upload-from", str(root), "--upload-to", location.url,
             "--upload-endpoint", s3.endpoint, "--upload-region", "us-east-1",
             "--upload-part-size", "5MiB", "--upload-scan-interval", "0.2"],
            env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_for(lambda: (fetch_json(url + "/v1/uploads") or (0, {}))[1]
                     .get("last_durable_step") == 7, timeout=60)
            wait_for(lambda: len(seen) >= 2, timeout=20)  # DescribeInstances, -ScheduledInstances
        finally:
            process.send_signal(signal.SIGTERM)
            process.wait(15)
    text = log_path.read_text()
    # It did log at DEBUG, the SDKs included: the test would see what they wrote.
    assert "DEBUG botocore" in text and "DEBUG volcenginesdkcore" in text, text[-3000:]
    for secret in SECRETS:
        assert secret not in text, secret
    authorization = [h["Authorization"] for h in seen]
    signatures = {value.rpartition("Signature=")[2] for value in authorization}
    assert all(len(signature) == 64 for signature in signatures)
    for value in (*authorization, *signatures):
        assert value not in text, value
    # botocore's own request lines, canonical request and signature are there, scrubbed
    assert "Authorization" in text and "Signature" in text
    for line in text.splitlines():
        lowered = line.lower()
        if "authorization" in lowered:
            assert "credential=" not in lowered or "credential=***" in lowered, line
        assert "signature=" not in lowered or "signature=***" in lowered, line


# Shapes the SDKs write at DEBUG, each with its secret part.
SHAPES = [
    ("botocore request", "Sending http request: <AWSPreparedRequest method=PUT, headers={"
     "'X-Amz-Security-Token': b'FwoGZXIvYXdzE', 'Authorization': b'AWS4-HMAC-SHA256 "
     "Credential=AKIAEXAMPLE/20261201/us-east-1/s3/aws4_request, SignedHeaders=host, "
     "Signature=0f3c'}>", ("FwoGZXIvYXdzE", "AKIAEXAMPLE", "0f3c")),
    ("canonical request", "CanonicalRequest:\nPUT\n/b/k\n\nhost:127.0.0.1\n"
     "x-amz-security-token:FwoGZXIvYXdzE\n", ("FwoGZXIvYXdzE",)),
    ("botocore signature", "Signature:\n" + "ab12" * 16, ("ab12" * 16,)),
    ("header lines", "    Authorization: HMAC-SHA256 Credential=AKLTX/20261201/cn-beijing/ecs/"
     "request, SignedHeaders=host, Signature=77aa\n    X-Security-Token: sts-token-value",
     ("AKLTX", "77aa", "sts-token-value")),
    ("STS JSON body", 'response body: {"Result": {"Credentials": {"AccessKeyId": "AKLTSTS", '
     '"SecretAccessKey": "c2VjcmV0", "SessionToken": "nCh2wYr", "ExpiredTime": "x"}}}',
     ("AKLTSTS", "c2VjcmV0", "nCh2wYr")),
    ("STS XML body", "<AccessKeyId>ASIAXML</AccessKeyId><SecretAccessKey>xmlsecret"
     "</SecretAccessKey><SessionToken>xmltoken</SessionToken>",
     ("ASIAXML", "xmlsecret", "xmltoken")),
    ("presigned URL", "GET /b/k?X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=AKIAQ%2F2026"
     "&X-Amz-Security-Token=IQoJb3&X-Amz-Signature=9f9f HTTP/1.1", ("AKIAQ", "IQoJb3", "9f9f")),
    ("a dict repr", "{'aws_secret_access_key': 'dictsecret', 'token': 'dicttoken'}",
     ("dictsecret", "dicttoken")),
    ("IMDS token", "headers: {'X-aws-ec2-metadata-token': 'AQAEAImds'}", ("AQAEAImds",)),
]


@pytest.mark.parametrize(("shape", "text", "secrets"), SHAPES, ids=[s[0] for s in SHAPES])
def test_every_shape_of_credential_is_scrubbed(shape: str, text: str,
                                               secrets: tuple[str, ...]) -> None:
    scrubbed = logscrub.scrub(text)
    for secret in secrets:
        assert secret not in scrubbed, (shape, scrubbed)
    assert "***" in scrubbed


def test_what_is_not_a_credential_is_left_alone() -> None:
    text = ('GET /?Action=DescribeScheduledInstances&ScheduledInstanceIds.1=esi-1 HTTP/1.1" 200 '
            '{"NextToken": "", "AutoReleaseAt": "2026-12-01T00:00:00+08:00"}')
    assert logscrub.scrub(text) == text


@pytest.fixture
def installed(monkeypatch: pytest.MonkeyPatch) -> Iterator[io.StringIO]:
    """``install()`` with a handler of our own; the record factory put back after."""
    monkeypatch.setenv("ESI_SIDECAR_UPLOAD_SECRET_KEY", "upload-secret-from-env")
    monkeypatch.setenv("SOME_TOKEN_FILE", "/etc/not-a-secret")  # a path, not a value
    factory = logging.getLogRecordFactory()
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logger = logging.getLogger("tests.logscrub")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False
    try:
        logscrub.install()
        logscrub.install()  # twice is once
        yield stream
    finally:
        logging.setLogRecordFactory(factory)
        logger.removeHandler(handler)


def test_install_scrubs_every_record_its_arguments_and_its_traceback(
        installed: io.StringIO) -> None:
    logger = logging.getLogger("tests.logscrub")
    logger.debug("sent %s", {"Authorization": "HMAC-SHA256 Credential=AKLTARG/x, Signature=1a"})
    logger.info("the key is %s", "upload-secret-from-env")
    try:
        raise RuntimeError("SecretAccessKey=tracebacksecret")
    except RuntimeError:
        logger.exception("failed")
    logger.info("state file %s", "/etc/not-a-secret")
    text = installed.getvalue()
    for secret in ("AKLTARG", "Signature=1a", "upload-secret-from-env", "tracebacksecret"):
        assert secret not in text, text
    assert "RuntimeError" in text and "/etc/not-a-secret" in text
    assert text.count("***") >= 3


def test_a_record_whose_arguments_do_not_format_is_still_scrubbed(
        installed: io.StringIO) -> None:
    logging.getLogger("tests.logscrub").warning("two %s %s", "Signature=5e5e")
    text = installed.getvalue()
    assert "5e5e" not in text and "two" in text
