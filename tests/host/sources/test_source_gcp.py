"""The gcp source against a fake GCE metadata server on loopback that speaks its wire
format (``Metadata-Flavor: Google`` both ways, ETags, ``wait_for_change`` long polls), and
through the real daemon: a preemption raised on the fake is served by /v1/expiry at once
and makes the guard save."""

from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any, Optional

import pytest
from daemon_harness import serve_daemon, wait_for

from sidecar.host.settings import Settings, load_settings
from sidecar.host.sources.base import SourceError
from sidecar.host.sources.gcp import GcpSource, long_poll_seconds_for
from sidecar.host.sources.registry import probe_source
from sidecar.models import KIND_MAINTENANCE, KIND_PREEMPTION
from sidecar.tools.emulator.aws import AwsImdsEmulator
from sidecar.tools.emulator.gcp import GcpMetadataEmulator, etag_of
from sidecar.train.client import SidecarClient
from sidecar.train.guard import CheckpointGuard
from sidecar.train.policy import SavePolicy


def probe(settings: Any, timeout: float) -> Optional[str]:
    return probe_source("gcp", settings, timeout)

INSTANCE = "/computeMetadata/v1/instance/"


@pytest.fixture
def gce() -> Iterator[GcpMetadataEmulator]:
    with GcpMetadataEmulator() as emulator:
        yield emulator


def source_for(gce: GcpMetadataEmulator, **options: Any) -> GcpSource:
    """Long polls of 1 s and a read timeout of 2 s keep the tests quick."""
    options.setdefault("long_poll_seconds", 1)
    options.setdefault("read_margin_seconds", 1.0)
    return GcpSource(gce.url, **options)


def get(url: str, headers: Optional[dict[str, str]] = None) -> tuple[int, str, Any]:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, response.read().decode(), response.headers
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(), exc.headers


def post(url: str, body: dict[str, Any]) -> tuple[int, Any]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


# ---------------------------------------------------------------------- notices


def test_no_notice_is_no_deadline_with_the_instance_id(gce: GcpMetadataEmulator) -> None:
    observation = source_for(gce).poll()
    assert observation.expires_at_unix is None and observation.notices == ()
    assert observation.instance_id == "5810234567890123456"


def test_preemption_is_served_30_s_after_first_seen_and_does_not_slide(
    gce: GcpMetadataEmulator,
) -> None:
    now = [1_900_000_000.0]
    source = source_for(gce, clock=lambda: now[0])
    source.poll()
    gce.preempt()
    first = source.poll()
    assert first.expires_at_unix == 1_900_000_030.0 and first.kind == KIND_PREEMPTION
    now[0] += 10  # later polls keep the first sighting
    assert source.poll().expires_at_unix == 1_900_000_030.0
    assert source.poll().expires_at_unix == 1_900_000_030.0
    gce.clear()  # preempted back to FALSE: forgotten
    assert source.poll().expires_at_unix is None
    gce.preempt()
    assert source.poll().expires_at_unix == 1_900_000_040.0


def test_a_gke_node_serves_a_preemption_15_s_after_first_seen() -> None:
    now = [1_900_000_000.0]
    with GcpMetadataEmulator(cluster_name="training-cluster") as gke:
        source = source_for(gke, clock=lambda: now[0])
        assert source.notice_seconds == 30.0  # not asked yet
        source.poll()
        assert source.gke is True and source.notice_seconds == 15.0
        gke.preempt()
        assert source.poll().expires_at_unix == 1_900_000_015.0
        told = source_for(gke, preemption_notice_seconds=45.0)  # a notice of its own wins
        told.poll()
        assert told.gke is True and told.notice_seconds == 45.0


def test_a_plain_vm_is_no_gke_node(gce: GcpMetadataEmulator) -> None:
    source = source_for(gce)
    source.poll()
    assert source.gke is False and source.notice_seconds == 30.0


def test_a_change_wakes_the_long_poll_waiting_for_it(gce: GcpMetadataEmulator) -> None:
    source = source_for(gce, long_poll_seconds=5, read_margin_seconds=2.0)
    source.poll()
    raised: list[float] = []

    def preempt_once_both_keys_wait() -> None:
        wait_for(lambda: gce.waiting() >= 2, timeout=5)
        raised.append(time.monotonic())
        gce.preempt()

    helper = threading.Thread(target=preempt_once_both_keys_wait)
    helper.start()
    observation = source.poll()
    answered = time.monotonic()
    helper.join()
    assert observation.kind == KIND_PREEMPTION
    assert answered - raised[0] < 1.0  # not the 5 s the long poll would have waited


def test_nothing_changing_is_one_long_poll_per_key_not_tight_polling(
    gce: GcpMetadataEmulator,
) -> None:
    source = source_for(gce)
    source.poll()
    before = gce.request_count()
    started = time.monotonic()
    assert source.poll().expires_at_unix is None
    assert time.monotonic() - started >= 0.9  # it waited out the 1 s long poll
    assert gce.request_count() - before == 3  # the two long polls, the maintenance window


@pytest.mark.parametrize(
    ("options", "machine_type", "notice_seconds"),
    [
        ({}, "a3-highgpu-8g", 3600.0),  # a GPU VM: a one-hour notice
        ({"gpu_vm": False}, "n2-standard-8", 60.0),  # others: 60 s
        ({"terminate_notice_seconds": 90.0}, "n2-standard-8", 90.0),
    ],
)
def test_terminate_on_host_maintenance_is_a_deadline(
    options: dict[str, Any], machine_type: str, notice_seconds: float
) -> None:
    now = [1_900_000_000.0]
    with GcpMetadataEmulator(machine_type=machine_type) as gce:
        source = source_for(gce, clock=lambda: now[0], **options)
        source.poll()
        gce.maintenance("TERMINATE_ON_HOST_MAINTENANCE")
        observation = source.poll()
        now[0] += 5
        assert source.poll().expires_at_unix == observation.expires_at_unix
    assert observation.expires_at_unix == 1_900_000_000.0 + notice_seconds
    assert observation.kind == KIND_MAINTENANCE


def test_live_migration_is_advisory_only(
    gce: GcpMetadataEmulator, caplog: pytest.LogCaptureFixture
) -> None:
    source = source_for(gce)
    source.poll()
    gce.maintenance("MIGRATE_ON_HOST_MAINTENANCE")
    with caplog.at_level(logging.WARNING, logger="sidecar.host.sources.gcp"):
        observation = source.poll()
        source.poll()
    assert observation.expires_at_unix is None
    assert [(n.kind, n.advisory) for n in observation.notices] == [(KIND_MAINTENANCE, True)]
    assert len([r for r in caplog.records if "live-migrated" in r.getMessage()]) == 1


def test_an_announced_maintenance_window_is_scheduled_maintenance(
    gce: GcpMetadataEmulator, caplog: pytest.LogCaptureFixture
) -> None:
    start = int(time.time()) + 86400
    gce.schedule_maintenance(start)
    source = source_for(gce)
    observation = source.poll()
    assert observation.expires_at_unix == start and observation.kind == KIND_MAINTENANCE
    gce.preempt()  # a preemption, 30 s away, comes first
    assert source.poll().kind == KIND_PREEMPTION
    gce.clear()
    gce.set_raw("upcoming-maintenance", "<html>oops")  # best effort: logged, not fatal
    with caplog.at_level(logging.WARNING, logger="sidecar.host.sources.gcp"):
        assert source.poll().expires_at_unix is None
        assert source.poll().expires_at_unix is None
    assert len([r for r in caplog.records if "maintenance window" in r.getMessage()]) == 1


# ---------------------------------------------------------------------- the wire format


def test_the_emulator_insists_on_the_flavor_header_as_gce_does(
    gce: GcpMetadataEmulator,
) -> None:
    url = gce.url + INSTANCE + "preempted"
    status, _, headers = get(url)
    assert status == 403 and headers["Metadata-Flavor"] == "Google"
    status, _, _ = get(url, {"Metadata-Flavor": "Google", "X-Forwarded-For": "10.0.0.9"})
    assert status == 403
    status, body, headers = get(url, {"Metadata-Flavor": "Google"})
    assert (status, body) == (200, "FALSE") and headers["ETag"] == etag_of("FALSE")


def test_the_emulator_long_polls_on_etags(gce: GcpMetadataEmulator) -> None:
    flavor = {"Metadata-Flavor": "Google"}
    url = gce.url + INSTANCE + "maintenance-event?wait_for_change=true&timeout_sec=1"
    started = time.monotonic()
    status, body, _ = get(url + "&last_etag=0000", flavor)  # not the current tag: at once
    assert (status, body) == (200, "NONE") and time.monotonic() - started < 0.5
    status, body, _ = get(url + "&last_etag=" + etag_of("NONE"), flavor)
    assert (status, body) == (200, "NONE") and time.monotonic() - started >= 1.0  # ran out
    assert get(url.replace("timeout_sec=1", "timeout_sec=soon"), flavor)[0] == 400
    gce.maintenance("MIGRATE_ON_HOST_MAINTENANCE")
    status, body, _ = get(gce.url + INSTANCE + "?recursive=true", flavor)
    directory = json.loads(body)
    assert directory["maintenanceEvent"] == "MIGRATE_ON_HOST_MAINTENANCE"
    assert directory["preempted"] == "FALSE" and directory["id"] == 5810234567890123456


@pytest.mark.parametrize(
    ("flavor", "message"),
    [(None, "no Metadata-Flavor header"), ("Amazon", "Metadata-Flavor: Amazon")],
)
def test_an_answer_not_from_gce_is_refused(
    gce: GcpMetadataEmulator, flavor: Optional[str], message: str
) -> None:
    gce.flavor = flavor
    with pytest.raises(SourceError, match=message):
        source_for(gce).poll()


@pytest.mark.parametrize(
    ("fault", "message"),
    [
        ({"kind": "status", "count": 1, "status": 503}, "HTTP 503"),
        ({"kind": "hang", "seconds": 3.0}, "no answer within 2 s"),
        # A captive portal's page: a 200 that is not from the metadata server.
        ({"kind": "malformed", "count": 1}, "no Metadata-Flavor header"),
    ],
)
def test_faults_are_one_line_errors_and_the_next_poll_is_fine(
    gce: GcpMetadataEmulator, fault: dict[str, Any], message: str
) -> None:
    source = source_for(gce)
    source.poll()
    gce.fail(**fault)
    with pytest.raises(SourceError, match=message) as failure:
        source.poll()
    assert "\n" not in str(failure.value) and "instance/" in str(failure.value)
    assert source.poll().expires_at_unix is None


@pytest.mark.parametrize(
    ("key", "body", "message"),
    [
        ("preempted", "MAYBE", "instance/preempted: expected TRUE or FALSE, got 'MAYBE'"),
        ("maintenance-event", "SOON", "instance/maintenance-event: unknown event 'SOON'"),
    ],
)
def test_garbage_values_are_refused_not_served(
    gce: GcpMetadataEmulator, key: str, body: str, message: str
) -> None:
    source = source_for(gce)
    gce.set_raw(key, body)
    with pytest.raises(SourceError, match=message):
        source.poll()
    gce.clear()
    assert source.poll().expires_at_unix is None


def test_no_metadata_server_fails_fast(unused_port: int) -> None:
    started = time.monotonic()
    with pytest.raises(SourceError, match="cannot connect: not on GCP"):
        GcpSource(f"http://127.0.0.1:{unused_port}").poll()
    assert time.monotonic() - started < 2.0


def test_probe_finds_gce_and_nothing_else(gce: GcpMetadataEmulator, unused_port: int) -> None:
    assert probe(Settings(gcp_metadata_url=gce.url), 0.5) is None
    missing = probe(Settings(gcp_metadata_url=f"http://127.0.0.1:{unused_port}"), 0.5)
    assert missing is not None and "cannot connect" in missing
    with AwsImdsEmulator() as aws:  # EC2's service at the same address: not GCE
        other = probe(Settings(gcp_metadata_url=aws.url), 0.5)
    assert other is not None and "without Metadata-Flavor: Google" in other


def test_the_http_control_api(gce: GcpMetadataEmulator) -> None:
    source = source_for(gce)
    source.poll()
    status, state = post(gce.url + "/_emulator/preempt", {})
    assert status == 200 and state["preempted"] is True
    assert source.poll().kind == KIND_PREEMPTION
    status, state = post(gce.url + "/_emulator/maintenance",
                         {"event": "TERMINATE_ON_HOST_MAINTENANCE"})
    assert status == 200 and state["maintenance_event"] == "TERMINATE_ON_HOST_MAINTENANCE"
    status, reply = post(gce.url + "/_emulator/maintenance", {"event": "SOMETIME"})
    assert status == 400 and "must be one of" in reply["error"]
    assert post(gce.url + "/_emulator/clear", {})[1]["preempted"] is False
    assert post(gce.url + "/_emulator/nope", {})[0] == 404


def test_settings_name_the_source_and_bound_the_long_poll() -> None:
    settings = load_settings({"source": ["gce"], "gcp_metadata_url": "http://127.0.0.1:1"},
                             environ={})
    assert settings.sources == ("gcp",) and settings.gcp_metadata_url == "http://127.0.0.1:1"
    # Well under the staleness bound (3 x --poll-interval), so a quiet long poll that runs
    # out still confirms the answer in time.
    assert long_poll_seconds_for(90.0) == 20
    assert long_poll_seconds_for(15.0) == 3
    assert long_poll_seconds_for(2.0) == 1


# ---------------------------------------------------------------------- end to end


def test_the_daemon_serves_a_preemption_at_once_and_the_guard_saves(
    gce: GcpMetadataEmulator,
) -> None:
    # The daemon's --poll-interval is 30 s; the gcp source long-polls regardless.
    with serve_daemon(sources=("gcp",), gcp_metadata_url=gce.url, poll_interval=30.0) as daemon:
        wait_for(lambda: daemon.store.health().ok)
        client = SidecarClient(daemon.url)
        assert client.expiry().expires_at_unix is None  # type: ignore[union-attr]
        # A save that takes 10 s fits in GCE's 30 s notice; the default 60 s would not.
        guard = CheckpointGuard(client, SavePolicy(save_seconds=10.0), environ={},
                                refresh_seconds=0.0, wait_for_release=False)
        guard.record_step(1.0)
        assert guard.should_save() is False
        wait_for(lambda: gce.waiting() >= 2)  # both keys are being long-polled
        raised = time.monotonic()
        gce.preempt()
        wait_for(lambda: client.expiry().expires_at_unix is not None,  # type: ignore[union-attr]
                 timeout=5)
        served_after = time.monotonic() - raised
        expiry = client.expiry()
        assert expiry is not None and expiry.kind == KIND_PREEMPTION and expiry.source == "gcp"
        assert expiry.remaining_seconds is not None and 25 < expiry.remaining_seconds <= 30
        assert guard.should_save() is True  # 30 s <= 1 + 10 + 120
    assert served_after < GcpSource.poll_interval_seconds + 0.1
