"""The aws source against a fake IMDS on loopback that speaks EC2's wire format
(IMDSv2 tokens with a TTL, 404 for "nothing planned", EC2's time formats), and through
the real daemon: a spot notice raised on the fake is served by /v1/expiry and makes the
guard save."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import pytest
from daemon_harness import serve_daemon, wait_for

from sidecar.host.settings import ConfigError, load_settings
from sidecar.host.sources.aws import AwsSource
from sidecar.host.sources.base import SourceError
from sidecar.models import KIND_MAINTENANCE, KIND_PREEMPTION
from sidecar.tools.emulator.aws import AwsImdsEmulator
from sidecar.train.client import SidecarClient
from sidecar.train.guard import CheckpointGuard

NOW = time.time()


@pytest.fixture
def imds() -> Iterator[AwsImdsEmulator]:
    with AwsImdsEmulator() as emulator:
        yield emulator


def source_for(imds: AwsImdsEmulator, **options: bool) -> AwsSource:
    return AwsSource(imds.url, **options)


def test_nothing_planned_is_no_deadline_with_the_instance_id(imds: AwsImdsEmulator) -> None:
    observation = source_for(imds).poll()
    assert observation.expires_at_unix is None
    assert observation.instance_id == "i-0123456789abcdef0"


def test_spot_interruption_notice_is_a_preemption_deadline(imds: AwsImdsEmulator) -> None:
    source = source_for(imds)
    source.poll()
    imds.interrupt(int(NOW) + 120, action="stop")
    observation = source.poll()
    assert observation.expires_at_unix == int(NOW) + 120
    assert observation.kind == KIND_PREEMPTION
    imds.clear()
    assert source.poll().expires_at_unix is None


def test_the_earliest_open_maintenance_event_counts(imds: AwsImdsEmulator) -> None:
    imds.schedule_maintenance(int(NOW) + 600, state="completed")  # done: ignored
    imds.schedule_maintenance(int(NOW) + 7200)
    imds.schedule_maintenance(int(NOW) + 3600, code="instance-stop")
    observation = source_for(imds).poll()
    assert observation.expires_at_unix == int(NOW) + 3600
    assert observation.kind == KIND_MAINTENANCE
    imds.interrupt(int(NOW) + 120)  # a spot notice earlier than that wins
    assert source_for(imds).poll().kind == KIND_PREEMPTION


def test_one_token_is_reused_and_an_expired_one_is_replaced(imds: AwsImdsEmulator) -> None:
    source = source_for(imds)
    for _ in range(3):
        source.poll()
    assert imds.token_requests == 1
    imds.expire_tokens()  # the next GET is a 401: a new token, and the poll still works
    imds.interrupt(int(NOW) + 120)
    assert source.poll().expires_at_unix == int(NOW) + 120
    assert imds.token_requests == 2
    assert ("GET", "/latest/meta-data/spot/instance-action", 401) in imds.requests


def test_imdsv1_only_when_allowed() -> None:
    with AwsImdsEmulator(imdsv1=True) as imds:
        imds.fail("status", count=1, status=403)  # the token request is refused
        with pytest.raises(SourceError, match="IMDSv1 is not used unless --aws-imdsv1 true"):
            source_for(imds).poll()
        imds.fail("status", count=1, status=403)
        imds.interrupt(int(NOW) + 120)
        allowed = source_for(imds, allow_imdsv1=True)
        assert allowed.poll().expires_at_unix == int(NOW) + 120
        assert allowed.poll().expires_at_unix == int(NOW) + 120  # stays on v1
        assert imds.request_count("/latest/api/token") == 2  # the refused v2 attempts only


@pytest.mark.parametrize(
    ("fault", "message"),
    [
        ({"kind": "status", "count": 1, "status": 503}, "HTTP 503"),
        ({"kind": "hang", "seconds": 3.0}, "no answer within 1 s"),
        ({"kind": "malformed", "count": 1}, "not JSON"),
    ],
)
def test_faults_are_one_line_errors(imds: AwsImdsEmulator, fault: dict, message: str) -> None:
    source = source_for(imds)
    source.poll()  # a token first, so that the fault hits a GET
    imds.fail(**fault)
    with pytest.raises(SourceError, match=message):
        source.poll()
    assert source.poll().expires_at_unix is None  # and the next poll is fine


@pytest.mark.parametrize(
    ("path", "body", "message"),
    [
        ("instance-action", '{"action": "terminate"}', "without a time"),
        ("instance-action", '{"action": "terminate", "time": "soon"}', "soon"),
        ("instance-action", '{"action": "terminate", "time": "1970-01-01T00:00:00Z"}',
         "before the year 2000"),
        ("scheduled", '{"NotBefore": "21 Jan 2019 09:00:43 GMT"}', "not a list"),
        ("scheduled", '[{"Code": "system-reboot", "State": "active", "NotBefore": "Tuesday"}]',
         "Tuesday"),
    ],
)
def test_malformed_notices_are_reported_not_served(
    imds: AwsImdsEmulator, path: str, body: str, message: str
) -> None:
    imds.set_raw(path, body)
    with pytest.raises(SourceError, match=message):
        source_for(imds).poll()


def test_no_metadata_service_fails_fast() -> None:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    started = time.monotonic()
    with pytest.raises(SourceError, match="cannot connect: not on EC2"):
        AwsSource(url).poll()
    assert time.monotonic() - started < 2.0


def test_rebalance_recommendation_is_logged_not_served(
    imds: AwsImdsEmulator, caplog: pytest.LogCaptureFixture
) -> None:
    imds.recommend_rebalance(int(NOW))
    source = source_for(imds)
    with caplog.at_level(logging.WARNING, logger="sidecar.host.sources.aws"):
        assert source.poll().expires_at_unix is None
        source.poll()
    warnings = [r.getMessage() for r in caplog.records if "rebalance" in r.getMessage()]
    assert len(warnings) == 1  # once per notice


def test_settings_name_the_source_and_its_options() -> None:
    settings = load_settings({"source": ["ec2"], "aws_imds_url": "http://127.0.0.1:1"},
                             environ={"ESI_SIDECAR_AWS_IMDSV1": "true"})
    assert settings.sources == ("aws",)
    assert settings.aws_imdsv1 is True and settings.aws_imds_url == "http://127.0.0.1:1"
    assert load_settings({}, environ={}).aws_imdsv1 is False
    with pytest.raises(ConfigError, match=r"--aws-imdsv1.*true or false"):
        load_settings({"aws_imdsv1": "maybe"}, environ={})


def test_the_daemon_serves_a_spot_notice_within_its_poll_and_the_guard_saves(
    imds: AwsImdsEmulator,
) -> None:
    # The daemon's --poll-interval is 30 s; the aws source polls every 2 s regardless.
    with serve_daemon(sources=("aws",), aws_imds_url=imds.url, poll_interval=30.0) as daemon:
        wait_for(lambda: daemon.store.health().ok)
        client = SidecarClient(daemon.url)
        assert client.expiry().expires_at_unix is None  # type: ignore[union-attr]
        guard = CheckpointGuard(client, environ={}, refresh_seconds=0.0,
                                wait_for_release=False)
        guard.record_step(1.0)
        assert guard.should_save() is False
        release = int(time.time()) + 120
        imds.interrupt(release)
        raised = time.monotonic()
        wait_for(lambda: (client.expiry().expires_at_unix  # type: ignore[union-attr]
                          == release), timeout=5)
        served_after = time.monotonic() - raised
        expiry = client.expiry()
        assert expiry is not None and expiry.kind == KIND_PREEMPTION and expiry.source == "aws"
        assert guard.should_save() is True  # 120 s <= 1 + 60 + 120
    assert served_after < 2.0 * 1.1 + 0.5  # one poll period (+10 % jitter) and some slack
