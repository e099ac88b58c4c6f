"""The azure source against a fake IMDS on loopback that speaks Azure's wire format
(``Metadata: true`` or a 400, a mandatory api-version, Scheduled Events documents with
their incarnation, RFC 1123 NotBefore, StartRequests approvals), and through the real
daemon: a Preempt raised on the fake is served by /v1/expiry and makes the guard save."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any, Optional, cast

import pytest
from daemon_harness import serve_daemon, wait_for

from sidecar.host.settings import load_settings
from sidecar.host.sources import azure
from sidecar.host.sources.azure import AzureSource
from sidecar.host.sources.base import SourceError
from sidecar.host.sources.registry import create_source, probe_source
from sidecar.models import KIND_MAINTENANCE, KIND_PREEMPTION
from sidecar.tools.emulator.aws import AwsImdsEmulator
from sidecar.tools.emulator.azure import AzureImdsEmulator
from sidecar.train.client import SidecarClient
from sidecar.train.guard import CheckpointGuard
from sidecar.train.policy import SavePolicy

EVENTS = "/metadata/scheduledevents?api-version=2020-07-01"


def probe(settings: Any, timeout: float) -> Optional[str]:
    return probe_source("azure", settings, timeout)


def from_settings(settings: Any) -> AzureSource:
    return cast(AzureSource, create_source("azure", settings))


@pytest.fixture
def imds() -> Iterator[AzureImdsEmulator]:
    with AzureImdsEmulator() as emulator:
        yield emulator


class Clock:
    """The source's wall clock, moved by hand."""

    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


def in_seconds(seconds: int) -> tuple[int, float]:
    """A whole-second deadline ``seconds`` from now, and the offset that schedules it."""
    at = int(time.time()) + seconds
    return at, at - time.time()


def raw(imds: AzureImdsEmulator, target: str, headers: Optional[dict[str, str]] = None,
        body: Optional[bytes] = None) -> tuple[int, Any]:
    request = urllib.request.Request(imds.url + target, data=body, headers=headers or {},
                                     method="POST" if body is not None else "GET")
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


def test_no_events_is_no_deadline_with_the_vm_id(imds: AzureImdsEmulator) -> None:
    observation = AzureSource(imds.url).poll()
    assert observation.expires_at_unix is None and observation.notices == ()
    assert observation.instance_id == imds.vm_id


def test_preempt_for_this_vm_is_a_preemption_deadline_at_not_before(
    imds: AzureImdsEmulator,
) -> None:
    source = AzureSource(imds.url)
    source.poll()
    at, offset = in_seconds(30)
    event_id = imds.schedule("Preempt", offset)
    observation = source.poll()
    assert observation.expires_at_unix == at and observation.kind == KIND_PREEMPTION
    assert observation.notices[0].detail == f"Preempt {event_id}"


def test_an_event_for_another_vm_is_ignored(imds: AzureImdsEmulator) -> None:
    imds.schedule("Preempt", 30, resources=["sidecar-vm-1"])  # a neighbour in the set
    assert AzureSource(imds.url).poll().expires_at_unix is None
    at, offset = in_seconds(600)
    imds.schedule("Reboot", offset, resources=["sidecar-vm-1", "SIDECAR-VM-0"])
    assert AzureSource(imds.url).poll().expires_at_unix == at  # names ignore case


@pytest.mark.parametrize("event_type", ["Terminate", "Reboot", "Redeploy"])
def test_terminate_reboot_and_redeploy_are_maintenance_deadlines(
    imds: AzureImdsEmulator, event_type: str
) -> None:
    at, offset = in_seconds(900)
    imds.schedule(event_type, offset)
    observation = AzureSource(imds.url).poll()
    assert observation.expires_at_unix == at and observation.kind == KIND_MAINTENANCE


def test_freeze_is_advisory_only(imds: AzureImdsEmulator) -> None:
    at, offset = in_seconds(900)
    event_id = imds.schedule("Freeze", offset)
    observation = AzureSource(imds.url).poll()
    assert observation.expires_at_unix is None
    (notice,) = observation.notices
    assert notice.advisory and notice.expires_at_unix == at
    assert notice.detail == f"Freeze {event_id}"


def test_the_earliest_deadline_wins(imds: AzureImdsEmulator) -> None:
    imds.schedule("Freeze", 60)  # advisory: earliest, but never the deadline
    imds.schedule("Redeploy", 1200)
    at, offset = in_seconds(300)
    imds.schedule("Preempt", offset)
    observation = AzureSource(imds.url).poll()
    assert observation.expires_at_unix == at and observation.kind == KIND_PREEMPTION
    assert len(observation.notices) == 3


def test_a_started_event_is_a_deadline_when_first_seen_and_does_not_slide(
    imds: AzureImdsEmulator,
) -> None:
    clock = Clock()
    source = AzureSource(imds.url, clock=clock)
    imds.schedule("Reboot", 0, status="Started")  # a host failure: no notice at all
    first_seen = clock.now
    assert source.poll().expires_at_unix == first_seen
    clock.now += 5
    assert source.poll().expires_at_unix == first_seen  # not "now" again


def test_a_scheduled_event_that_starts_early_is_due_when_seen_started(
    imds: AzureImdsEmulator,
) -> None:
    clock = Clock()
    source = AzureSource(imds.url, clock=clock)
    at, offset = in_seconds(600)
    event_id = imds.schedule("Redeploy", offset)
    assert source.poll().expires_at_unix == at
    imds.start_event(event_id)  # approved by a neighbour: it begins before NotBefore
    clock.now += 10
    started = clock.now
    assert source.poll().expires_at_unix == started
    clock.now += 10
    assert source.poll().expires_at_unix == started


def test_approve_is_recorded_by_azure_and_the_event_leaves_pending(
    imds: AzureImdsEmulator,
) -> None:
    clock = Clock()
    source = AzureSource(imds.url, approve_enabled=True, clock=clock)
    source.poll()
    event_id = imds.schedule("Preempt", 30)
    first_seen = clock.now
    source.poll()
    assert source.pending() == [(event_id, first_seen, "Preempt")]
    incarnation = imds.describe()["document"]["DocumentIncarnation"]
    source.approve([event_id])
    assert imds.approved == [event_id] and source.pending() == []
    document = imds.describe()["document"]
    assert document["DocumentIncarnation"] == incarnation + 1
    assert document["Events"][0]["EventStatus"] == "Started"  # as Azure: it begins now
    assert document["Events"][0]["NotBefore"] == ""
    clock.now += 1
    observation = source.poll()
    assert observation.expires_at_unix == clock.now  # the VM goes now
    assert source.pending() == []


def test_approval_is_refused_when_off_or_not_ours_and_failures_are_errors(
    imds: AzureImdsEmulator,
) -> None:
    event_id = imds.schedule("Reboot", 900)
    other = imds.schedule("Reboot", 900, resources=["sidecar-vm-1"])
    off = AzureSource(imds.url)
    off.poll()
    with pytest.raises(SourceError, match="--azure-approve true"):
        off.approve([event_id])
    source = AzureSource(imds.url, approve_enabled=True)
    source.poll()
    with pytest.raises(SourceError, match="not an event of this VM"):
        source.approve([other])
    imds.fail("status", status=500)
    with pytest.raises(SourceError, match="approval: HTTP 500"):
        source.approve([event_id])
    assert imds.approved == [] and [p[0] for p in source.pending()] == [event_id]
    source.approve([])  # nothing to do: no request
    assert imds.request_count("/metadata/scheduledevents") == 3  # 2 polls, 1 failed POST


def test_the_metadata_header_is_required(
    imds: AzureImdsEmulator, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert raw(imds, EVENTS) == (
        400, {"error": "Bad request. Required metadata header not specified"})
    status, body = raw(imds, EVENTS, {"Metadata": "true", "X-Forwarded-For": "10.0.0.1"})
    assert status == 400 and "X-Forwarded-For" in body["error"]
    monkeypatch.setattr(azure, "METADATA_HEADERS", {})  # a client that forgets it
    with pytest.raises(SourceError) as failure:
        AzureSource(imds.url).poll()
    message = str(failure.value)
    assert "HTTP 400" in message and "Required metadata header not specified" in message
    assert "\n" not in message


def test_the_api_version_is_required(imds: AzureImdsEmulator) -> None:
    status, body = raw(imds, "/metadata/scheduledevents", {"Metadata": "true"})
    assert status == 400 and "api-version" in body["error"]
    assert body["newest-versions"][0] == "2020-07-01"
    status, _ = raw(imds, "/metadata/instance?api-version=2030-01-01", {"Metadata": "true"})
    assert status == 400
    status, body = raw(imds, "/metadata/instance?api-version=2021-02-01", {"Metadata": "true"})
    assert status == 200 and body["compute"]["name"] == imds.vm_name


def test_the_incarnation_grows_with_every_change(imds: AzureImdsEmulator) -> None:
    def incarnation() -> int:
        status, body = raw(imds, EVENTS, {"Metadata": "true"})
        assert status == 200
        return int(body["DocumentIncarnation"])

    first = incarnation()
    assert incarnation() == first  # reading changes nothing
    event_id = imds.schedule("Freeze", 900)
    imds.start_event(event_id)
    imds.complete(event_id)
    assert incarnation() == first + 3
    imds.clear()  # nothing left to clear: no change
    assert incarnation() == first + 3


@pytest.mark.parametrize(
    ("fault", "message"),
    [
        ({"kind": "status", "count": 1, "status": 503}, "HTTP 503"),
        ({"kind": "hang", "seconds": 3.0}, "no answer within 1 s"),
        ({"kind": "malformed", "count": 1}, "not JSON"),
    ],
)
def test_faults_are_one_line_errors(imds: AzureImdsEmulator, fault: dict, message: str) -> None:
    source = AzureSource(imds.url)
    source.poll()  # past the first, slow-to-answer request, and the name is known
    imds.fail(**fault)
    with pytest.raises(SourceError, match=message) as failure:
        source.poll()
    assert "\n" not in str(failure.value)
    assert source.poll().expires_at_unix is None  # and the next poll is fine


def test_the_first_request_may_take_long_the_others_may_not(imds: AzureImdsEmulator) -> None:
    # Azure switches Scheduled Events on at the first request and may take minutes.
    source = AzureSource(imds.url, read_timeout=0.2, first_read_timeout=5.0)
    imds.fail("hang", seconds=0.5)
    assert source.poll().expires_at_unix is None
    imds.fail("hang", seconds=0.5)
    with pytest.raises(SourceError, match=r"no answer within 0\.2 s"):
        source.poll()


def test_throttling_is_marked(imds: AzureImdsEmulator) -> None:
    source = AzureSource(imds.url)
    source.poll()
    imds.fail("status", status=429)  # more than 5 requests a second
    with pytest.raises(SourceError) as failure:
        source.poll()
    assert failure.value.throttled


def test_no_metadata_service_fails_fast(unused_port: int) -> None:
    started = time.monotonic()
    with pytest.raises(SourceError, match="cannot connect: not on Azure"):
        AzureSource(f"http://127.0.0.1:{unused_port}").poll()
    assert time.monotonic() - started < 2.0


def test_an_unparsable_not_before_is_an_error_naming_the_event(
    imds: AzureImdsEmulator,
) -> None:
    event_id = imds.schedule("Preempt", 30, not_before="Tuesday")
    with pytest.raises(SourceError, match=f"Preempt {event_id}: NotBefore: .*Tuesday"):
        AzureSource(imds.url).poll()


def test_probe_finds_azure_and_says_why_not_elsewhere(
    imds: AzureImdsEmulator, unused_port: int
) -> None:
    settings = load_settings({"azure_metadata_url": imds.url}, environ={})
    assert probe(settings, 1.0) is None
    nowhere = load_settings({"azure_metadata_url": f"http://127.0.0.1:{unused_port}"},
                            environ={})
    assert probe(nowhere, 1.0) == f"no Azure metadata service at {nowhere.azure_metadata_url}" \
        " (cannot connect)"
    with AwsImdsEmulator() as ec2:  # another cloud's metadata service at the address
        reason = probe(load_settings({"azure_metadata_url": ec2.url}, environ={}), 1.0)
    assert reason is not None and "HTTP 404" in reason


def test_settings_name_the_source_and_its_approval(imds: AzureImdsEmulator) -> None:
    settings = load_settings({"source": ["az"], "azure_metadata_url": imds.url},
                             environ={"ESI_SIDECAR_AZURE_APPROVE": "true"})
    assert settings.sources == ("azure",)
    source = from_settings(settings)
    assert source.approve_enabled is True and source.name == "azure"
    assert source.poll().instance_id == imds.vm_id
    assert from_settings(load_settings({}, environ={})).approve_enabled is False


def test_the_http_control_api(imds: AzureImdsEmulator) -> None:
    status, state = raw(imds, "/_emulator/event", body=json.dumps(
        {"type": "Preempt", "in_seconds": 30}).encode())
    assert status == 200
    (event,) = state["document"]["Events"]
    assert event["EventType"] == "Preempt" and event["Resources"] == [imds.vm_name]
    assert event["NotBefore"].endswith(" GMT")  # "Mon, 19 Sep 2016 18:29:47 GMT"
    assert AzureSource(imds.url).poll().kind == KIND_PREEMPTION
    status, state = raw(imds, "/_emulator/start", body=json.dumps(
        {"id": event["EventId"]}).encode())
    assert status == 200 and state["document"]["Events"][0]["EventStatus"] == "Started"
    status, body = raw(imds, "/_emulator/event", body=b'{"type": "Explode"}')
    assert status == 400 and "Explode" in body["error"]
    status, state = raw(imds, "/_emulator/clear", body=b"{}")
    assert status == 200 and state["document"]["Events"] == []


def test_the_daemon_serves_a_preempt_within_its_poll_and_the_guard_saves(
    imds: AzureImdsEmulator,
) -> None:
    # The daemon's --poll-interval is 30 s; the azure source polls every second regardless.
    with serve_daemon(sources=("azure",), azure_metadata_url=imds.url,
                      poll_interval=30.0) as daemon:
        wait_for(lambda: daemon.store.health().ok)
        client = SidecarClient(daemon.url)
        assert client.expiry().expires_at_unix is None  # type: ignore[union-attr]
        # A job sized for Azure Spot: a save well inside the 30 s a Preempt gives.
        policy = SavePolicy(save_seconds=10.0, redundant_seconds=30.0)
        guard = CheckpointGuard(client, policy, environ={}, refresh_seconds=0.0,
                                wait_for_release=False)
        guard.record_step(1.0)
        assert guard.should_save() is False
        release, offset = in_seconds(30)  # a Preempt's minimum notice
        imds.schedule("Preempt", offset)
        raised = time.monotonic()
        wait_for(lambda: (client.expiry().expires_at_unix  # type: ignore[union-attr]
                          == release), timeout=5)
        served_after = time.monotonic() - raised
        expiry = client.expiry()
        assert expiry is not None and expiry.kind == KIND_PREEMPTION
        assert expiry.source == "azure" and expiry.instance_id == imds.vm_id
        assert guard.should_save() is True  # 10 s <= 30 s left <= 1 + 10 + 30
    assert served_after < AzureSource.poll_interval_seconds * 1.1 + 0.1
