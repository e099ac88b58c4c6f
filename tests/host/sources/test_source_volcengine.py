"""The Volcengine ESI source: the real SDK over HTTP against the emulator on 127.0.0.1."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from datetime import datetime, timezone, tzinfo
from typing import Any, Optional
from zoneinfo import ZoneInfo

import pytest
import urllib3
import volcenginesdkcore
import volcenginesdkecs

from sidecar.host.sources.base import Source, SourceError
from sidecar.host.sources.registry import create_source
from sidecar.host.sources.volcengine import VolcengineConfig, VolcengineEsiSource, build
from sidecar.models import KIND_SCHEDULED_RELEASE
from sidecar.tools.emulator import Emulator

AK = "AKLTsourcetest00000001"
SK = "source-test-secret-xyz"
TOKEN = "sts-session-token-abc"
RELEASE = "2026-12-01T00:00:00+08:00"
RELEASE_UNIX = datetime(2026, 11, 30, 16, 0, tzinfo=timezone.utc).timestamp()
PROXY_VARS = ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy", "NO_PROXY", "no_proxy")
DEAD_PROXY = "http://127.0.0.1:9"


@pytest.fixture(autouse=True)
def _isolated_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """Credentials for the emulator, no proxies, and no way for the SDK's credential
    chain to reach the real metadata address or a real CLI config."""
    for name in (*PROXY_VARS, "VOLCENGINE_SESSION_TOKEN", "VOLCENGINE_OIDC_ROLE_TRN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("VOLCENGINE_ACCESS_KEY", AK)
    monkeypatch.setenv("VOLCENGINE_SECRET_KEY", SK)
    monkeypatch.setenv("VOLCENGINE_ECS_METADATA_DISABLED", "true")
    monkeypatch.setenv("VOLCENGINE_CLI_CONFIG_FILE", str(tmp_path / "absent.json"))


@pytest.fixture
def emu() -> Iterator[Emulator]:
    with Emulator(access_key=AK, secret_key=SK, auto_release_at=RELEASE) as emulator:
        yield emulator


def settings(emu: Emulator, **overrides: Any) -> VolcengineConfig:
    values: dict[str, Any] = {
        "instance_id": emu.instance_id,
        "scheduled_instance_id": None,
        "region": emu.region,
        "api_endpoint": emu.url,
        "metadata_url": emu.url,
        "naive_timezone": timezone.utc,
    }
    values.update(overrides)
    return VolcengineConfig(**values)


def source_for(emu: Emulator, **overrides: Any) -> VolcengineEsiSource:
    return build(settings(emu, **overrides))


def poll_error(source: VolcengineEsiSource) -> SourceError:
    with pytest.raises(SourceError) as caught:
        source.poll()
    return caught.value


def closed_port_url() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    return f"http://127.0.0.1:{port}"


# -- happy paths ---------------------------------------------------------------------


def test_happy_path_reads_the_offset(emu: Emulator) -> None:
    observation = source_for(emu).poll()
    assert observation.expires_at_unix == RELEASE_UNIX
    assert observation.kind == KIND_SCHEDULED_RELEASE
    assert observation.instance_id == "i-emu0001"
    assert observation.scheduled_instance_id == "esi-emu0001"
    assert observation.assumed_timezone is None


def test_release_in_follows_the_emulator(emu: Emulator) -> None:
    source = source_for(emu)
    emu.set_release_in(3600)
    expires = source.poll().expires_at_unix
    assert expires is not None and abs(expires - (time.time() + 3600)) <= 2
    emu.set_release(RELEASE)
    assert source.poll().expires_at_unix == RELEASE_UNIX


def test_is_a_source_registered_by_name(emu: Emulator) -> None:
    source = create_source("volcengine-esi", settings(emu))
    assert isinstance(source, Source)
    assert source.name == "volcengine-esi"
    assert source.poll().expires_at_unix == RELEASE_UNIX


def test_metadata_discovery_when_ids_are_unset(emu: Emulator) -> None:
    source = source_for(emu, instance_id=None, region=None)
    for _ in range(3):
        observation = source.poll()
    assert observation.instance_id == "i-emu0001"
    assert observation.expires_at_unix == RELEASE_UNIX
    # instance_id and region_id, asked once each and then cached.
    assert emu.metadata_request_count() == 2


def test_scheduled_instance_id_is_looked_up_once(emu: Emulator) -> None:
    source = source_for(emu)
    for _ in range(4):
        assert source.poll().scheduled_instance_id == "esi-emu0001"
    assert emu.request_count("DescribeInstances") == 1
    assert emu.request_count("DescribeScheduledInstances") == 4


def test_configured_scheduled_instance_id_skips_describe_instances(emu: Emulator) -> None:
    source = source_for(emu, instance_id=None, scheduled_instance_id="esi-emu0001")
    observation = source.poll()
    assert observation.expires_at_unix == RELEASE_UNIX
    assert observation.scheduled_instance_id == "esi-emu0001"
    assert emu.request_count("DescribeInstances") == 0
    assert emu.metadata_request_count() == 0


def test_session_token_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VOLCENGINE_SESSION_TOKEN", TOKEN)
    with Emulator(
        access_key=AK, secret_key=SK, session_token=TOKEN, auto_release_at=RELEASE
    ) as emu:
        assert source_for(emu).poll().expires_at_unix == RELEASE_UNIX


# -- no deadline is not an error -----------------------------------------------------


def test_non_esi_instance_is_healthy_with_no_deadline() -> None:
    with Emulator(access_key=AK, secret_key=SK, scheduled_instance_id=None) as emu:
        observation = source_for(emu).poll()
    assert observation.expires_at_unix is None
    assert observation.kind is None
    assert observation.instance_id == "i-emu0001"
    assert observation.scheduled_instance_id is None


def test_non_esi_answer_is_not_cached(emu: Emulator) -> None:
    source = source_for(emu)
    emu.inject_fault("non-esi", count=1)
    assert source.poll().expires_at_unix is None
    assert source.poll().expires_at_unix == RELEASE_UNIX


@pytest.mark.parametrize("served", ["", None])
def test_empty_or_absent_release_is_no_deadline(emu: Emulator, served: Optional[str]) -> None:
    emu.set_release(served)
    observation = source_for(emu).poll()
    assert observation.expires_at_unix is None
    assert observation.scheduled_instance_id == "esi-emu0001"


def test_empty_release_fault(emu: Emulator) -> None:
    emu.inject_fault("empty-release", count=1)
    source = source_for(emu)
    assert source.poll().expires_at_unix is None
    assert source.poll().expires_at_unix == RELEASE_UNIX


# -- timestamp formats ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("served", "zone", "expected_unix", "assumed"),
    [
        ("2026-11-30T16:00:00Z", timezone.utc, RELEASE_UNIX, None),
        ("2026-12-01 00:00:00", ZoneInfo("Asia/Shanghai"), RELEASE_UNIX, "Asia/Shanghai"),
        # dateutil only: slashes, a month name, an offset without a colon.
        (
            "2026/12/01 08:00:00",
            ZoneInfo("Asia/Shanghai"),
            RELEASE_UNIX + 8 * 3600,
            "Asia/Shanghai",
        ),
        ("2026/11/30 16:00:00", timezone.utc, RELEASE_UNIX, "UTC"),
        ("1 Dec 2026 00:00:00 +0800", timezone.utc, RELEASE_UNIX, None),
    ],
)
def test_timestamp_formats(
    emu: Emulator, served: str, zone: tzinfo, expected_unix: float, assumed: Optional[str]
) -> None:
    emu.set_release(served)
    observation = source_for(emu, naive_timezone=zone).poll()
    assert observation.expires_at_unix == expected_unix
    assert observation.assumed_timezone == assumed


@pytest.mark.parametrize("served", ["2026-12-01 00:00:00", "2026-12-01T00:00:00",
                                    "2026/12/01 00:00:00"])
def test_a_time_without_an_offset_is_read_in_beijing_time_unless_told(
        emu: Emulator, served: str) -> None:
    # The API writes +08:00 and every Volcengine region lies at UTC+8 or west of it: read
    # as UTC (the old default) a naive release came 8 h late; as UTC+8 it is the earliest
    # plausible instant. --timezone still decides when it is set.
    emu.set_release(served)
    observation = source_for(emu, naive_timezone=None).poll()
    assert observation.expires_at_unix == RELEASE_UNIX
    assert observation.assumed_timezone == "UTC+08:00"
    told = source_for(emu, naive_timezone=timezone.utc).poll()
    assert told.expires_at_unix == RELEASE_UNIX + 8 * 3600 and told.assumed_timezone == "UTC"


@pytest.mark.parametrize("served", ["not-a-time", "Dec 2026", "08:00", "2026-13-45T00:00:00Z"])
def test_unparseable_release_names_the_value(emu: Emulator, served: str) -> None:
    emu.set_release(served)
    error = poll_error(source_for(emu))
    assert repr(served) in str(error)
    assert not error.throttled


def test_bad_release_fault(emu: Emulator) -> None:
    emu.inject_fault("bad-release", count=1)
    source = source_for(emu)
    assert "'not-a-time'" in str(poll_error(source))
    assert source.poll().expires_at_unix == RELEASE_UNIX


# -- API failures --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "code"), [("throttle", "Throttling.User"), ("flow-limit", "FlowLimitExceeded")]
)
def test_throttling_is_marked(emu: Emulator, kind: str, code: str) -> None:
    source = source_for(emu)
    source.poll()
    emu.inject_fault(kind, count=1)
    error = poll_error(source)
    assert error.throttled
    assert "HTTP 429" in str(error) and code in str(error)
    # The SDK did not retry on its own: one throttled request, then nothing until asked.
    assert emu.request_count("DescribeScheduledInstances") == 2
    assert source.poll().expires_at_unix == RELEASE_UNIX


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("server-error", "DescribeScheduledInstances failed: HTTP 500 InternalError"),
        ("auth", "DescribeScheduledInstances failed: HTTP 401 SignatureDoesNotMatch"),
        ("malformed-json", "DescribeScheduledInstances failed: malformed response"),
    ],
)
def test_failures_become_one_line_errors(emu: Emulator, kind: str, expected: str) -> None:
    source = source_for(emu)
    source.poll()
    emu.inject_fault(kind, count=1)
    error = poll_error(source)
    assert str(error).startswith(expected)
    assert "\n" not in str(error)
    assert not error.throttled
    assert source.poll().expires_at_unix == RELEASE_UNIX


def test_failure_on_the_first_call_names_describe_instances(emu: Emulator) -> None:
    emu.inject_fault("server-error", count=1)
    assert str(poll_error(source_for(emu))).startswith("DescribeInstances failed: HTTP 500")


def test_read_timeout(emu: Emulator) -> None:
    source = VolcengineEsiSource(
        instance_id="i-emu0001",
        scheduled_instance_id="esi-emu0001",
        region=emu.region,
        api_endpoint=emu.url,
        read_timeout=0.2,
    )
    emu.inject_fault("slow", count=1, delay=3.0)
    started = time.monotonic()
    error = poll_error(source)
    assert time.monotonic() - started < 2.5
    assert "timed out after 0.2 s" in str(error)
    assert not error.throttled


def test_connection_refused() -> None:
    url = closed_port_url()
    source = VolcengineEsiSource(instance_id="i-1", region="cn-beijing", api_endpoint=url)
    error = poll_error(source)
    assert f"cannot connect to {url}" in str(error)


def test_unknown_instance_id_is_named(emu: Emulator) -> None:
    error = poll_error(source_for(emu, instance_id="i-doesnotexist"))
    assert "'i-doesnotexist'" in str(error) and "not found" in str(error)


def test_unknown_scheduled_instance_id_is_named(emu: Emulator) -> None:
    error = poll_error(source_for(emu, scheduled_instance_id="esi-doesnotexist"))
    assert "'esi-doesnotexist'" in str(error) and "not found" in str(error)


# -- metadata failures ---------------------------------------------------------------


def test_metadata_down_is_retried_within_the_poll_then_reported(emu: Emulator) -> None:
    source = source_for(emu, instance_id=None)
    emu.inject_fault("metadata-down", count=3)
    error = poll_error(source)
    assert "metadata service" in str(error) and "HTTP 500" in str(error)
    assert "ESI_SIDECAR_INSTANCE_ID" in str(error)
    assert emu.metadata_request_count() == 3
    assert source.poll().instance_id == "i-emu0001"


def test_metadata_recovers_within_one_poll(emu: Emulator) -> None:
    emu.inject_fault("metadata-down", count=1)
    assert source_for(emu, region=None).poll().expires_at_unix == RELEASE_UNIX


def test_metadata_unreachable_names_the_setting(emu: Emulator) -> None:
    source = source_for(emu, region=None, metadata_url=closed_port_url())
    error = poll_error(source)
    assert "ESI_SIDECAR_REGION" in str(error)


# -- proxies -------------------------------------------------------------------------


def set_dead_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in PROXY_VARS[:4]:
        monkeypatch.setenv(name, DEAD_PROXY)


def test_proxy_environment_does_not_capture_a_loopback_endpoint(
    emu: Emulator, monkeypatch: pytest.MonkeyPatch
) -> None:
    set_dead_proxy(monkeypatch)
    source = source_for(emu, instance_id=None, region=None)
    assert source.poll().expires_at_unix == RELEASE_UNIX


def test_the_sdk_alone_would_use_the_dead_proxy(
    emu: Emulator, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Why the source swaps the connection pool: without it this is what happens.
    set_dead_proxy(monkeypatch)
    configuration = volcenginesdkcore.Configuration()
    configuration.ak, configuration.sk, configuration.region = AK, SK, emu.region
    configuration.host = emu.url
    configuration.auto_retry = False
    api = volcenginesdkecs.ECSApi(volcenginesdkcore.ApiClient(configuration))
    with pytest.raises(urllib3.exceptions.ProxyError):
        api.describe_instances(
            volcenginesdkecs.DescribeInstancesRequest(instance_ids=["i-emu0001"])
        )
    assert emu.request_count() == 0


def test_no_proxy_is_honoured_for_a_named_endpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NO_PROXY", "ecs.internal.example")
    assert VolcengineEsiSource._bypass_proxy("http://ecs.internal.example:9000")
    assert not VolcengineEsiSource._bypass_proxy("https://ecs.cn-beijing.volcengineapi.com")
    assert VolcengineEsiSource._bypass_proxy("http://localhost:9000")
    assert VolcengineEsiSource._bypass_proxy("http://[::1]:9000")


# -- credentials and secrets ---------------------------------------------------------


def test_secrets_never_appear_in_errors(emu: Emulator, monkeypatch: pytest.MonkeyPatch) -> None:
    messages = []
    for kind in ("throttle", "server-error", "auth", "malformed-json", "bad-release"):
        emu.inject_fault(kind, count=1)
        messages.append(str(poll_error(source_for(emu))))
    # The service echoes an unknown access key back in its message.
    monkeypatch.setenv("VOLCENGINE_ACCESS_KEY", "AKLTunknownkey0000001")
    error = str(poll_error(source_for(emu)))
    assert "InvalidAccessKey" in error and "***" in error
    messages.append(error)
    for message in messages:
        for secret in (AK, SK, "AKLTunknownkey0000001"):
            assert secret not in message


def test_missing_credentials_say_which_variables(
    emu: Emulator, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("VOLCENGINE_ACCESS_KEY")
    monkeypatch.delenv("VOLCENGINE_SECRET_KEY")
    error = str(poll_error(source_for(emu)))
    assert "VOLCENGINE_ACCESS_KEY" in error and "VOLCENGINE_SECRET_KEY" in error
    assert emu.request_count() == 0


def test_half_set_credentials_name_the_missing_one(
    emu: Emulator, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("VOLCENGINE_SECRET_KEY")
    error = str(poll_error(source_for(emu)))
    assert error.startswith("VOLCENGINE_SECRET_KEY is not set")
    assert AK not in error


def test_bad_endpoint_is_refused_at_construction() -> None:
    with pytest.raises(ValueError, match="api_endpoint"):
        VolcengineEsiSource(api_endpoint="127.0.0.1:9000")


def test_signature_shaped_text_is_scrubbed() -> None:
    # Defence in depth: should an SDK or proxy message ever echo request headers.
    source = VolcengineEsiSource(region="cn-beijing")
    text = (
        "Authorization: HMAC-SHA256 Credential=AKLTx/20261129/cn-beijing/ecs/request, "
        "SignedHeaders=host;x-date, Signature=0123abcd\nX-Security-Token: tok123\n" + SK
    )
    cleaned = source._clean(text)
    for secret in ("AKLTx", "0123abcd", "tok123", SK):
        assert secret not in cleaned
    assert "\n" not in cleaned


@pytest.mark.parametrize(
    ("body", "reason", "expected"),
    [
        ('{"ResponseMetadata": {"Error": {"Code": "C", "Message": "M"}}}', None, ("C", "M")),
        # An error inside an HTTP 200 answer: the SDK passes str(dict) as the reason.
        (None, "{'Code': 'Throttling.User', 'Message': 'slow'}", ("Throttling.User", "slow")),
        ("<html>Bad Gateway</html>", "Bad Gateway", (None, "<html>Bad Gateway</html>")),
        (None, "InternalServiceError", (None, "InternalServiceError")),
    ],
)
def test_error_fields_wherever_the_sdk_left_them(
    body: Optional[str], reason: Optional[str], expected: tuple[Optional[str], Optional[str]]
) -> None:
    from sidecar.host.sources.volcengine import _error_fields

    assert _error_fields(body, reason) == expected


def test_the_sdk_leaves_process_logging_alone(emu: Emulator) -> None:
    """The SDK's Configuration() adds its own stderr handler to urllib3's logger and stops
    propagation; the source undoes it so the daemon's logging config applies."""
    import logging

    source_for(emu).poll()
    for name in ("urllib3", "com.volcengine.sdkcore"):
        logger = logging.getLogger(name)
        assert logger.propagate is True
        assert not [h for h in logger.handlers if getattr(h, "_volcengine_sdk_handler", False)]
