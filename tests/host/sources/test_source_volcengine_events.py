"""The volcengine-events source: DescribeSystemEvents through the real SDK, signed, over
HTTP against the emulator on 127.0.0.1, and through the real daemon next to the ESI
release (the earliest wins, every notice is listed)."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Iterator
from datetime import datetime, timezone
from typing import Any

import pytest
from daemon_harness import get_json, serve_daemon, wait_for

from sidecar.host.sources.base import SourceError
from sidecar.host.sources.volcengine import VolcengineConfig
from sidecar.host.sources.volcengine_events import (
    SPOT_NOTICE_SECONDS,
    VolcengineEventsSource,
    build,
    event_notice,
)
from sidecar.models import KIND_MAINTENANCE, KIND_PREEMPTION, KIND_SCHEDULED_RELEASE
from sidecar.tools.emulator import Emulator
from sidecar.tools.emulator.state import release_in
from sidecar.train.client import SidecarClient
from sidecar.train.guard import CheckpointGuard

AK = "AKLTeventstest0000001"
SK = "events-test-secret-xyz"


@pytest.fixture(autouse=True)
def _credentials(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    for name in ("HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy",
                 "VOLCENGINE_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("VOLCENGINE_ACCESS_KEY", AK)
    monkeypatch.setenv("VOLCENGINE_SECRET_KEY", SK)
    monkeypatch.setenv("VOLCENGINE_ECS_METADATA_DISABLED", "true")
    monkeypatch.setenv("VOLCENGINE_CLI_CONFIG_FILE", str(tmp_path / "absent.json"))


@pytest.fixture
def emu() -> Iterator[Emulator]:
    with Emulator(access_key=AK, secret_key=SK, auto_release_at=None) as emulator:
        yield emulator


def source_for(emu: Emulator, **overrides: Any) -> VolcengineEventsSource:
    values: dict[str, Any] = {"instance_id": None, "scheduled_instance_id": None,
                              "region": None, "api_endpoint": emu.url,
                              "metadata_url": emu.url, "naive_timezone": timezone.utc}
    values.update(overrides)
    return build(VolcengineConfig(**values))


def test_no_events_is_no_deadline_and_the_instance_comes_from_metadata(emu: Emulator) -> None:
    observation = source_for(emu).poll()
    assert observation.expires_at_unix is None and observation.notices == ()
    assert observation.instance_id == emu.instance_id
    assert emu.request_count("DescribeSystemEvents") == 1


def test_a_spot_interruption_is_a_preemption_five_minutes_after_the_event(
    emu: Emulator,
) -> None:
    source = source_for(emu)
    before = int(time.time())
    emu.raise_event("SpotInstanceInterruption_Delete", created_ago=20)
    observation = source.poll()
    assert observation.kind == KIND_PREEMPTION
    assert observation.expires_at_unix is not None
    # CreatedAt (20 s ago, whole seconds) + the five-minute notice
    assert before - 21 + SPOT_NOTICE_SECONDS <= observation.expires_at_unix
    assert observation.expires_at_unix <= before - 19 + SPOT_NOTICE_SECONDS
    (notice,) = observation.notices
    assert "SpotInstanceInterruption_Delete" in (notice.detail or "")


def test_operated_start_at_is_the_deadline_and_the_earliest_event_wins(emu: Emulator) -> None:
    emu.raise_event("SystemMaintenance_Redeploy", in_seconds=7200)
    emu.raise_event("SystemFailure_Stop", in_seconds=1800, status="Executing")
    emu.raise_event("SystemFailure_PleaseCheck")  # advice: listed, never the deadline
    observation = source_for(emu).poll()
    assert observation.kind == KIND_MAINTENANCE
    expected = release_in(1800)
    assert observation.expires_at_unix is not None
    assert abs(observation.expires_at_unix - (time.time() + 1800)) < 3, expected
    assert [n.advisory for n in observation.notices].count(True) == 1
    assert len(observation.notices) == 3


@pytest.mark.parametrize("status", ["Succeeded", "Canceled", "Recovered", "Rejected"])
def test_ended_events_count_for_nothing(emu: Emulator, status: str) -> None:
    emu.raise_event("SpotInstanceInterruption_Delete", status=status)
    assert source_for(emu).poll().expires_at_unix is None


def test_other_instances_and_unrelated_types_are_ignored(emu: Emulator) -> None:
    emu.raise_event("SpotInstanceInterruption_Delete", resource_id="i-someone-else")
    emu.raise_event("InstanceCreated_Notify")  # not about the instance's end
    assert source_for(emu).poll().expires_at_unix is None


def test_every_page_is_read(emu: Emulator) -> None:
    for _ in range(120):  # more than one page of 100
        emu.raise_event("SystemFailure_PleaseCheck")
    emu.raise_event("SpotInstanceInterruption_Delete")  # the last one, on page two
    observation = source_for(emu).poll()
    assert observation.kind == KIND_PREEMPTION
    assert emu.request_count("DescribeSystemEvents") == 2


def test_the_dotted_form_and_an_esi_auto_release_are_understood() -> None:
    created = "2026-12-01T10:00:00+08:00"
    dotted = {"Id": "e-1", "Type": "SpotInstanceInterruption.Delete", "Status": "Scheduled",
              "CreatedAt": created, "OperatedStartAt": ""}
    notice = event_notice(dotted, first_seen=0.0)
    assert notice is not None and notice.kind == KIND_PREEMPTION
    release = dict(dotted, Type="ElasticScheduledInstance_AutoRelease",
                   OperatedStartAt="2026-12-01T12:00:00+08:00")
    notice = event_notice(release, first_seen=0.0)
    assert notice is not None and notice.kind == KIND_SCHEDULED_RELEASE
    noon_beijing = datetime(2026, 12, 1, 4, 0, tzinfo=timezone.utc).timestamp()
    assert notice.expires_at_unix == noon_beijing


def test_an_event_time_without_an_offset_is_read_in_beijing_time() -> None:
    event = {"Id": "e-3", "Type": "SystemMaintenance_Redeploy", "Status": "Scheduled",
             "CreatedAt": "2026-12-01T10:00:00+08:00", "OperatedStartAt": "2026-12-01 12:00:00"}
    assumed: set[str] = set()
    notice = event_notice(event, first_seen=0.0, assumed=assumed)
    noon_beijing = datetime(2026, 12, 1, 4, 0, tzinfo=timezone.utc).timestamp()
    assert notice is not None and notice.expires_at_unix == noon_beijing
    assert assumed == {"UTC+08:00"}
    with_offsets = event_notice(dict(event, OperatedStartAt="2026-12-01T12:00:00+08:00"),
                                first_seen=0.0, assumed=(none := set()))
    assert with_offsets is not None and none == set()


def test_without_any_time_the_deadline_counts_from_first_seen() -> None:
    event = {"Id": "e-2", "Type": "SystemFailure_Redeploy", "Status": "Scheduled"}
    notice = event_notice(event, first_seen=1_900_000_000.0)
    assert notice is not None
    assert notice.expires_at_unix == 1_900_000_000.0 + SPOT_NOTICE_SECONDS


def test_a_time_that_is_not_a_time_is_one_line_naming_the_event(emu: Emulator) -> None:
    event_id = emu.raise_event("SystemMaintenance_Redeploy", in_seconds=600)
    source = source_for(emu)
    source.poll()
    emu._state.update_event(event_id, OperatedStartAt="next tuesday")
    with pytest.raises(SourceError, match=rf"event {event_id} OperatedStartAt") as caught:
        source.poll()
    assert "\n" not in str(caught.value)


def test_throttling_is_reported_as_such_and_the_next_poll_works(emu: Emulator) -> None:
    source = source_for(emu)
    emu.inject_fault("throttle", count=1)
    with pytest.raises(SourceError) as caught:
        source.poll()
    assert caught.value.throttled and "DescribeSystemEvents" in str(caught.value)
    assert source.poll().expires_at_unix is None


def test_events_are_raised_and_cleared_over_the_control_api(emu: Emulator) -> None:
    def post(body: dict[str, Any], method: str = "POST") -> dict[str, Any]:
        request = urllib.request.Request(emu.url + "/_emulator/event", method=method,
                                         data=json.dumps(body).encode())
        with urllib.request.urlopen(request, timeout=5) as response:
            return json.loads(response.read())

    state = post({"type": "SpotInstanceInterruption_Delete", "in_seconds": 240})
    assert state["system_events"][0]["Type"] == "SpotInstanceInterruption_Delete"
    assert source_for(emu).poll().kind == KIND_PREEMPTION
    assert post({}, method="DELETE")["system_events"] == []
    with pytest.raises(urllib.error.HTTPError) as refused:
        post({"in_seconds": "soon"})
    assert refused.value.code == 400


def test_the_daemon_serves_an_event_next_to_the_release_and_the_guard_saves(
    emu: Emulator,
) -> None:
    emu.set_release_in(7200)
    with serve_daemon(sources=("volcengine-esi", "volcengine-events"), api_endpoint=emu.url,
                      metadata_url=emu.url, poll_interval=0.2) as daemon:
        wait_for(lambda: daemon.store.health().ok)
        body = get_json(daemon.url + "/v1/expiry")[1]
        assert body["kind"] == KIND_SCHEDULED_RELEASE and len(body["notices"]) == 1
        client = SidecarClient(daemon.url)
        guard = CheckpointGuard(client, environ={}, refresh_seconds=0.0,
                                wait_for_release=False)
        guard.record_step(1.0)
        assert guard.should_save() is False
        # Raised 130 s ago (the poll missed it so far): about 170 s left of the notice.
        emu.raise_event("SpotInstanceInterruption_Delete", created_ago=130)
        raised = time.monotonic()
        wait_for(lambda: get_json(daemon.url + "/v1/expiry")[1]["kind"] == KIND_PREEMPTION,
                 timeout=5)
        served_after = time.monotonic() - raised
        body = get_json(daemon.url + "/v1/expiry")[1]
        assert body["source"] == "volcengine-events"
        assert [n["source"] for n in body["notices"]] == ["volcengine-events",
                                                          "volcengine-esi"]
        assert guard.should_save() is True  # ~170 s <= 1 + 60 + 120
    assert served_after < 0.2 * 1.1 + 0.5  # one poll period (+10 % jitter) and slack
