"""The Volcengine emulator: wire format, signature checks against the real SDK, metadata
paths, the control API over HTTP and every fault kind. Real sockets on 127.0.0.1."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from typing import Any, Optional
from urllib.parse import urlencode, urlsplit

import pytest
import volcenginesdkcore
import volcenginesdkecs
from volcenginesdkcore.rest import ApiException

from sidecar.tools.emulator import FAULT_KINDS, Emulator
from sidecar.tools.emulator.signing import Credentials, sign_headers

AK = "AKLTtest0123456789"
SK = "test-secret-key-abcdef"
RELEASE = "2026-12-01T00:00:00+08:00"
NO_PROXY_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@pytest.fixture(autouse=True)
def _no_proxy_no_cloud(monkeypatch: pytest.MonkeyPatch) -> None:
    # The SDK would send loopback requests through a proxy from the environment, and
    # its credential chain would ask the real metadata address: neither may happen here.
    for name in ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("VOLCENGINE_ECS_METADATA_DISABLED", "true")


@pytest.fixture
def emu() -> Iterator[Emulator]:
    with Emulator(access_key=AK, secret_key=SK, auto_release_at=RELEASE) as emulator:
        yield emulator


def sdk(
    url: str, ak: str = AK, sk: str = SK, token: Optional[str] = None, region: str = "cn-beijing"
) -> Any:
    configuration = volcenginesdkcore.Configuration()
    configuration.ak, configuration.sk, configuration.region = ak, sk, region
    configuration.session_token = token or ""
    configuration.host = url
    configuration.auto_retry = False
    return volcenginesdkecs.ECSApi(volcenginesdkcore.ApiClient(configuration))


def describe_instances(api: Any, *ids: str) -> Any:
    return api.describe_instances(volcenginesdkecs.DescribeInstancesRequest(instance_ids=list(ids)))


def describe_scheduled(api: Any, *ids: str) -> Any:
    request = volcenginesdkecs.DescribeScheduledInstancesRequest(scheduled_instance_ids=list(ids))
    return api.describe_scheduled_instances(request)


def served_release(api: Any) -> Optional[str]:
    """The AutoReleaseAt the emulated ESI serves, as the SDK reads it."""
    (info,) = describe_scheduled(api, "esi-emu0001").scheduled_instance_info
    value: Optional[str] = info.auto_release_at
    return value


def http(
    url: str, method: str = "GET", body: Any = None, headers: Optional[dict[str, str]] = None
) -> tuple[int, bytes]:
    data = None
    if body is not None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    try:
        with NO_PROXY_OPENER.open(request, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, exc.read()


def signed_get(
    emu: Emulator,
    query: list[tuple[str, str]],
    *,
    credentials: Optional[Credentials] = None,
    now: Optional[datetime] = None,
    send_query: Optional[list[tuple[str, str]]] = None,
) -> tuple[int, Any]:
    """A hand-signed GET, for requests no SDK would send."""
    host = urlsplit(emu.url).netloc
    headers = sign_headers(
        method="GET",
        host=host,
        query=query,
        credentials=credentials or Credentials(AK, SK),
        region=emu.region,
        service="ecs",
        now=now,
    )
    status, body = http(f"{emu.url}/?{urlencode(send_query or query)}", headers=headers)
    return status, body


def error_code(exc: ApiException) -> str:
    return str(json.loads(exc.body)["ResponseMetadata"]["Error"]["Code"])


# -- the OpenAPI wire format ---------------------------------------------------------


def test_sdk_reads_describe_instances(emu: Emulator) -> None:
    result = describe_instances(sdk(emu.url), "i-emu0001")
    assert result.total_count == 1
    (instance,) = result.instances
    assert instance.instance_id == "i-emu0001"
    assert instance.scheduled_instance_id == "esi-emu0001"
    assert instance.status == "RUNNING"
    assert instance.zone_id == "cn-beijing-a"


def test_sdk_reads_describe_scheduled_instances(emu: Emulator) -> None:
    (info,) = describe_scheduled(sdk(emu.url), "esi-emu0001").scheduled_instance_info
    assert info.scheduled_instance_id == "esi-emu0001"
    assert info.auto_release_at == RELEASE
    assert info.status


def test_raw_answer_has_the_service_envelope(emu: Emulator) -> None:
    query = [
        ("ScheduledInstanceIds.1", "esi-emu0001"),
        ("Action", "DescribeScheduledInstances"),
        ("Version", "2020-04-01"),
    ]
    status, body = signed_get(emu, query)
    assert status == 200
    answer = json.loads(body)
    metadata = answer["ResponseMetadata"]
    assert metadata["Action"] == "DescribeScheduledInstances"
    assert metadata["Version"] == "2020-04-01"
    assert metadata["Service"] == "ecs"
    assert metadata["Region"] == "cn-beijing"
    assert metadata["RequestId"]
    assert "Error" not in metadata
    assert answer["Result"]["NextToken"] == ""
    assert answer["Result"]["ScheduledInstanceInfo"][0]["AutoReleaseAt"] == RELEASE


def test_unknown_ids_give_empty_lists(emu: Emulator) -> None:
    api = sdk(emu.url)
    result = describe_instances(api, "i-nope")
    assert result.instances == [] and result.total_count == 0
    assert describe_scheduled(api, "esi-nope").scheduled_instance_info == []


def test_release_none_leaves_the_field_out_and_empty_is_served(emu: Emulator) -> None:
    api = sdk(emu.url)
    emu.set_release(None)
    assert served_release(api) is None
    emu.set_release("")
    assert served_release(api) == ""


def test_set_release_in_uses_the_api_offset(emu: Emulator) -> None:
    before = time.time()
    value = emu.set_release_in(600)
    assert value.endswith("+08:00")
    served = describe_scheduled(sdk(emu.url), "esi-emu0001").scheduled_instance_info[0]
    assert served.auto_release_at == value
    # Whole seconds, rounded down: never further away than asked.
    assert before + 599 <= datetime.fromisoformat(value).timestamp() <= time.time() + 600


def test_request_count_by_action(emu: Emulator) -> None:
    api = sdk(emu.url)
    describe_instances(api, "i-emu0001")
    describe_scheduled(api, "esi-emu0001")
    describe_scheduled(api, "esi-emu0001")
    assert emu.request_count("DescribeInstances") == 1
    assert emu.request_count("DescribeScheduledInstances") == 2
    assert emu.request_count() == 3


def test_missing_action_and_unknown_action(emu: Emulator) -> None:
    status, body = http(f"{emu.url}/?Version=2020-04-01")
    assert status == 400
    assert json.loads(body)["ResponseMetadata"]["Error"]["Code"] == "MissingParameter"
    status, body = signed_get(emu, [("Action", "RebootInstances"), ("Version", "2020-04-01")])
    assert status == 404
    assert json.loads(body)["ResponseMetadata"]["Error"]["Code"] == "InvalidActionOrVersion"


# -- signatures ----------------------------------------------------------------------


def test_wrong_secret_key_is_rejected(emu: Emulator) -> None:
    with pytest.raises(ApiException) as caught:
        describe_instances(sdk(emu.url, sk="not-the-secret"), "i-emu0001")
    assert caught.value.status == 401
    assert error_code(caught.value) == "SignatureDoesNotMatch"


def test_unknown_access_key_is_rejected(emu: Emulator) -> None:
    with pytest.raises(ApiException) as caught:
        describe_instances(sdk(emu.url, ak="AKLTsomeoneelse"), "i-emu0001")
    assert caught.value.status == 401
    assert error_code(caught.value) == "InvalidAccessKey"


def test_signature_for_another_region_is_rejected(emu: Emulator) -> None:
    with pytest.raises(ApiException) as caught:
        describe_instances(sdk(emu.url, region="cn-shanghai"), "i-emu0001")
    assert error_code(caught.value) == "SignatureDoesNotMatch"


def test_unsigned_request_is_rejected(emu: Emulator) -> None:
    status, body = http(f"{emu.url}/?Action=DescribeInstances&Version=2020-04-01")
    assert status == 401
    assert json.loads(body)["ResponseMetadata"]["Error"]["Code"] == "MissingAuthenticationToken"


def test_tampered_query_is_rejected(emu: Emulator) -> None:
    signed = [("Action", "DescribeInstances"), ("Version", "2020-04-01"), ("InstanceIds.1", "a")]
    sent = [("Action", "DescribeInstances"), ("Version", "2020-04-01"), ("InstanceIds.1", "b")]
    status, body = signed_get(emu, signed, send_query=sent)
    assert status == 401
    assert json.loads(body)["ResponseMetadata"]["Error"]["Code"] == "SignatureDoesNotMatch"


def test_hand_signed_request_is_accepted_and_a_skewed_clock_is_not(emu: Emulator) -> None:
    query = [("Action", "DescribeInstances"), ("Version", "2020-04-01")]
    assert signed_get(emu, query)[0] == 200
    status, body = signed_get(emu, query, now=datetime.now(timezone.utc) - timedelta(hours=1))
    assert status == 400
    assert json.loads(body)["ResponseMetadata"]["Error"]["Code"] == "InvalidTimestamp"


def test_session_token_is_required_and_checked() -> None:
    with Emulator(access_key=AK, secret_key=SK, session_token="sts-token-123") as emu:
        assert describe_instances(sdk(emu.url, token="sts-token-123"), "i-emu0001").total_count == 1
        for token in (None, "sts-token-999"):
            with pytest.raises(ApiException) as caught:
                describe_instances(sdk(emu.url, token=token), "i-emu0001")
            assert caught.value.status == 401
            assert error_code(caught.value) == "InvalidSecretToken"


def test_token_sent_to_an_account_without_sessions_is_rejected(emu: Emulator) -> None:
    with pytest.raises(ApiException) as caught:
        describe_instances(sdk(emu.url, token="sts-token-123"), "i-emu0001")
    assert error_code(caught.value) == "InvalidSecretToken"


# -- metadata ------------------------------------------------------------------------


def test_metadata_paths_answer_plain_text(emu: Emulator) -> None:
    assert http(f"{emu.url}/latest/instance_id") == (200, b"i-emu0001")
    assert http(f"{emu.url}/latest/region_id") == (200, b"cn-beijing")
    assert http(f"{emu.url}/latest/nothing")[0] == 404
    assert emu.metadata_request_count() == 3


# -- control API over HTTP -----------------------------------------------------------


def test_control_state(emu: Emulator) -> None:
    status, body = http(f"{emu.url}/_emulator/state")
    state = json.loads(body)
    assert status == 200
    assert state["auto_release_at"] == RELEASE
    assert state["instance_id"] == "i-emu0001"
    assert state["faults"] == []
    assert set(state["fault_kinds"]) == set(FAULT_KINDS)


def test_control_release(emu: Emulator) -> None:
    status, body = http(f"{emu.url}/_emulator/release", "POST", {"auto_release_at": "x"})
    assert status == 200 and json.loads(body)["auto_release_at"] == "x"
    assert served_release(sdk(emu.url)) == "x"
    before = time.time()
    status, body = http(f"{emu.url}/_emulator/release", "POST", {"in_seconds": 60})
    value = json.loads(body)["auto_release_at"]
    assert status == 200 and value.endswith("+08:00")
    assert abs(datetime.fromisoformat(value).timestamp() - (before + 60)) <= 2


def test_control_fault_and_clear(emu: Emulator) -> None:
    status, body = http(f"{emu.url}/_emulator/fault", "POST", {"kind": "server-error"})
    assert status == 200
    assert json.loads(body)["faults"] == [{"kind": "server-error", "remaining": None, "delay": 0.0}]
    api = sdk(emu.url)
    with pytest.raises(ApiException):
        describe_instances(api, "i-emu0001")
    status, body = http(f"{emu.url}/_emulator/fault", "DELETE")
    assert status == 200 and json.loads(body)["faults"] == []
    assert describe_instances(api, "i-emu0001").total_count == 1


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("release", b"not json"),
        ("release", [1, 2]),
        ("release", {}),
        ("release", {"auto_release_at": "x", "in_seconds": 5}),
        ("release", {"in_seconds": True}),
        ("release", {"in_seconds": "60"}),
        ("release", {"auto_release_at": 5}),
        ("fault", {"kind": "meteor"}),
        ("fault", {"kind": "throttle", "count": 0}),
        ("fault", {"kind": "slow", "delay": -1}),
        ("fault", {"kind": "throttle", "colour": "red"}),
        ("fault", {}),
    ],
)
def test_control_rejects_bad_bodies(emu: Emulator, path: str, body: Any) -> None:
    status, answer = http(f"{emu.url}/_emulator/{path}", "POST", body)
    assert status == 400
    assert json.loads(answer)["error"]
    assert emu.snapshot()["faults"] == [] and emu.snapshot()["auto_release_at"] == RELEASE


def test_control_unknown_path_and_wrong_method(emu: Emulator) -> None:
    assert http(f"{emu.url}/_emulator/nothing")[0] == 404
    assert http(f"{emu.url}/_emulator/release")[0] == 405
    assert http(f"{emu.url}/_emulator/state", "POST", {})[0] == 405


# -- faults --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "status", "code"),
    [
        ("throttle", 429, "Throttling.User"),
        ("flow-limit", 429, "FlowLimitExceeded"),
        ("server-error", 500, "InternalError"),
        ("auth", 401, "SignatureDoesNotMatch"),
    ],
)
def test_error_faults(emu: Emulator, kind: str, status: int, code: str) -> None:
    emu.inject_fault(kind, count=1)
    api = sdk(emu.url)
    with pytest.raises(ApiException) as caught:
        describe_scheduled(api, "esi-emu0001")
    assert caught.value.status == status
    assert error_code(caught.value) == code
    # count=1: the next request is answered normally.
    assert served_release(api) == RELEASE


def test_malformed_json_fault(emu: Emulator) -> None:
    emu.inject_fault("malformed-json", count=1)
    query = [("Action", "DescribeInstances"), ("Version", "2020-04-01")]
    status, body = signed_get(emu, query)
    assert status == 200
    with pytest.raises(ValueError):
        json.loads(body)
    assert json.loads(signed_get(emu, query)[1])["Result"]["TotalCount"] == 1


def test_slow_fault_delays_the_answer(emu: Emulator) -> None:
    emu.inject_fault("slow", count=1, delay=0.3)
    api = sdk(emu.url)
    started = time.monotonic()
    describe_instances(api, "i-emu0001")
    assert time.monotonic() - started >= 0.3


@pytest.mark.parametrize(("kind", "served"), [("bad-release", "not-a-time"), ("empty-release", "")])
def test_release_faults(emu: Emulator, kind: str, served: str) -> None:
    emu.inject_fault(kind, count=1)
    api = sdk(emu.url)
    # DescribeInstances does not use up a release fault.
    describe_instances(api, "i-emu0001")
    assert served_release(api) == served
    assert served_release(api) == RELEASE


def test_non_esi_fault_drops_the_scheduled_instance_id(emu: Emulator) -> None:
    emu.inject_fault("non-esi")
    query = [("Action", "DescribeInstances"), ("Version", "2020-04-01")]
    instance = json.loads(signed_get(emu, query)[1])["Result"]["Instances"][0]
    assert "ScheduledInstanceId" not in instance
    assert describe_instances(sdk(emu.url), "i-emu0001").instances[0].scheduled_instance_id is None


def test_metadata_down_fault(emu: Emulator) -> None:
    emu.inject_fault("metadata-down", count=2)
    assert http(f"{emu.url}/latest/instance_id")[0] == 500
    assert http(f"{emu.url}/latest/region_id")[0] == 500
    assert http(f"{emu.url}/latest/instance_id") == (200, b"i-emu0001")


def test_fault_until_cleared(emu: Emulator) -> None:
    emu.inject_fault("server-error")
    api = sdk(emu.url)
    for _ in range(3):
        with pytest.raises(ApiException):
            describe_instances(api, "i-emu0001")
    emu.clear_faults()
    assert describe_instances(api, "i-emu0001").total_count == 1


def test_error_fault_does_not_use_up_a_release_fault(emu: Emulator) -> None:
    emu.inject_fault("throttle", count=1)
    emu.inject_fault("bad-release", count=1)
    api = sdk(emu.url)
    with pytest.raises(ApiException):
        describe_scheduled(api, "esi-emu0001")
    assert served_release(api) == "not-a-time"


def test_inject_fault_validates(emu: Emulator) -> None:
    with pytest.raises(ValueError, match="unknown fault kind"):
        emu.inject_fault("meteor")
    with pytest.raises(ValueError):
        emu.inject_fault("throttle", count=-1)
    with pytest.raises(ValueError):
        emu.inject_fault("slow", delay=float("nan"))


def test_non_esi_instance() -> None:
    with Emulator(access_key=AK, secret_key=SK, scheduled_instance_id=None) as emu:
        api = sdk(emu.url)
        assert describe_instances(api, "i-emu0001").instances[0].scheduled_instance_id is None
        assert describe_scheduled(api, "esi-emu0001").scheduled_instance_info == []


# -- lifecycle -----------------------------------------------------------------------


def test_start_stop_releases_the_port() -> None:
    emu = Emulator(access_key=AK, secret_key=SK)
    url = emu.start()
    assert url == emu.url and url.startswith("http://127.0.0.1:")
    with pytest.raises(RuntimeError):
        emu.start()
    emu.stop()
    emu.stop()
    with pytest.raises(RuntimeError):
        _ = emu.url
    with pytest.raises(urllib.error.URLError):
        NO_PROXY_OPENER.open(f"{url}/latest/instance_id", timeout=5)


def test_stop_wakes_a_slow_request() -> None:
    emu = Emulator(access_key=AK, secret_key=SK)
    emu.start()
    emu.inject_fault("slow", delay=60)
    outcome: list[Any] = []

    def call() -> None:
        try:
            outcome.append(describe_instances(sdk(emu.url), "i-emu0001").total_count)
        except Exception as exc:  # the answer may be cut off by the shutdown
            outcome.append(exc)

    caller = threading.Thread(target=call)
    caller.start()
    deadline = time.monotonic() + 10
    while emu.request_count() == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    started = time.monotonic()
    emu.stop()
    caller.join(timeout=10)
    assert not caller.is_alive()
    assert time.monotonic() - started < 10
    assert outcome
