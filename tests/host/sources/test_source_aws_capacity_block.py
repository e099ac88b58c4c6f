"""The aws-capacity-block source through the real botocore (its SigV4 signing and credential
chain) against the EC2 stand-in, which speaks EC2's Query API (form-encoded POST, XML
answers and errors) and checks every signature; and through the real daemon on port 0:
a Capacity Block's end is served 30 minutes early, its extension is a renewal, and its
failures never hide another source's deadline."""

from __future__ import annotations

import collections
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from daemon_harness import get_json, serve_daemon, wait_for

from sidecar.host.schedule import adaptive_interval
from sidecar.host.settings import load_settings
from sidecar.host.sources.aws_capacity_block import (
    NO_CREDENTIALS,
    TERMINATION_LEAD_SECONDS,
    CapacityBlockSource,
)
from sidecar.host.sources.base import SourceAbsent, SourceError, SourceRefused
from sidecar.host.sources.registry import auto_candidates, spec
from sidecar.models import KIND_SCHEDULED_RELEASE
from sidecar.tools.emulator.ec2 import (
    DEFAULT_AWS_ACCESS_KEY,
    DEFAULT_AWS_SECRET_KEY,
    Ec2Emulator,
)

NAME = "aws-capacity-block"
URL_SETTINGS = ("metadata_url", "aws_imds_url", "gcp_metadata_url", "azure_metadata_url")


@pytest.fixture(autouse=True)
def _aws_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """The stand-in's key pair in the environment, and nothing else botocore could find:
    no shared files, no profile, no other endpoint or region."""
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_DEFAULT_REGION",
                 "AWS_REGION", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_EC2",
                 "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
                 "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_EC2_METADATA_SERVICE_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", DEFAULT_AWS_ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", DEFAULT_AWS_SECRET_KEY)


@pytest.fixture
def ec2() -> Iterator[Ec2Emulator]:
    with Ec2Emulator() as emulator:
        yield emulator


def source_for(ec2: Ec2Emulator, **options: Any) -> CapacityBlockSource:
    return CapacityBlockSource(ec2.url, ec2_endpoint=ec2.url, **options)


def daemon_settings(ec2: Ec2Emulator, *sources: str, **overrides: Any) -> dict[str, Any]:
    settings: dict[str, Any] = {
        "sources": sources or (NAME,), "aws_imds_url": ec2.url, "poll_interval": 0.3,
        "source_options": {"aws_ec2_endpoint": ec2.url},
        "max_api_rate": 1e6,  # the stand-in has no account to protect
    }
    settings.update(overrides)
    return settings


def expiry(daemon: Any) -> Any:
    return get_json(daemon.url + "/v1/expiry")[1]


# ---------------------------------------------------------------------- the source


def test_the_deadline_is_the_block_end_less_ec2s_termination_lead(ec2: Ec2Emulator) -> None:
    end = int(time.time()) + 86400
    ec2.set_block_end(end)
    observation = source_for(ec2).poll()
    assert TERMINATION_LEAD_SECONDS == 1800.0
    assert observation.expires_at_unix == end - 1800
    assert observation.kind == KIND_SCHEDULED_RELEASE
    assert observation.instance_id == "i-0123456789abcdef0"
    assert observation.notices[0].detail is not None
    assert "cr-0a1b2c3d4e5f60718" in observation.notices[0].detail


def test_an_extension_moves_the_deadline_later_one_call_a_poll(ec2: Ec2Emulator) -> None:
    end = int(time.time()) + 7200
    ec2.set_block_end(end)
    source = source_for(ec2)
    assert source.poll().expires_at_unix == end - 1800
    ec2.extend_block(86400)
    assert source.poll().expires_at_unix == end + 86400 - 1800
    # DescribeInstances once (the reservation is cached), then one call a poll.
    assert ec2.api_calls("DescribeInstances") == 1
    assert ec2.api_calls("DescribeCapacityReservations") == 2
    assert ec2.request_count("/latest/api/token") == 1


@pytest.mark.parametrize(("reservation", "reason"), [
    (None, "outside any capacity reservation: not in a Capacity Block"),
    ("default", "a default reservation, not a Capacity Block"),
])
def test_an_instance_outside_a_block_is_not_applicable(ec2: Ec2Emulator, reservation: Any,
                                                       reason: str) -> None:
    ec2.set_reservation(reservation)
    with pytest.raises(SourceAbsent, match=reason) as absent:
        source_for(ec2).poll()
    assert absent.value.retry_after == 3600.0  # asked again hourly: two calls


@pytest.mark.parametrize(("fault", "message", "throttled"), [
    ("throttle", "HTTP 503 RequestLimitExceeded", True),
    ("status", "HTTP 500 InternalError", False),
    ("garbage", "malformed response", False),
])
def test_api_faults_are_one_line_errors_and_the_next_poll_mends(
        ec2: Ec2Emulator, fault: str, message: str, throttled: bool) -> None:
    source = source_for(ec2)
    source.poll()
    ec2.api_fail(fault)
    with pytest.raises(SourceError, match=message) as failed:
        source.poll()
    assert failed.value.throttled is throttled and not isinstance(failed.value, SourceRefused)
    assert source.poll().expires_at_unix is not None


def test_a_hung_or_trickling_endpoint_costs_one_bounded_call(ec2: Ec2Emulator) -> None:
    source = source_for(ec2, call_seconds=0.5)
    source.poll()
    ec2.api_fail("hang", seconds=2.0)
    started = time.monotonic()
    with pytest.raises(SourceError, match=r"no whole answer within 0\.5 s"):
        source.poll()
    with pytest.raises(SourceError, match="previous call has not ended"):
        source.poll()  # none started beside the one left behind
    assert time.monotonic() - started < 1.5
    wait_for(lambda: _polls(source), timeout=5, interval=0.1)


def _polls(source: CapacityBlockSource) -> bool:
    try:
        return source.poll().expires_at_unix is not None
    except SourceError:
        return False


@pytest.mark.parametrize(("variable", "value", "message"), [
    ("AWS_SECRET_ACCESS_KEY", "wrong-secret", "HTTP 401 AuthFailure"),
    ("AWS_ACCESS_KEY_ID", "AKIAUNKNOWN000000000", "HTTP 401 AuthFailure"),
])
def test_credentials_the_stand_in_refuses_are_a_refusal(
        ec2: Ec2Emulator, monkeypatch: pytest.MonkeyPatch, variable: str, value: str,
        message: str) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(SourceRefused, match=message):
        source_for(ec2).poll()


def test_no_credentials_is_one_clear_line_before_any_call(
        ec2: Ec2Emulator, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(SourceRefused) as refused:
        source_for(ec2).poll()
    assert str(refused.value) == NO_CREDENTIALS
    assert ec2.api_calls() == 0
    # botocore asked the instance role of the metadata service configured, none other.
    assert ec2.request_count("/latest/meta-data/iam/security-credentials/") >= 1


# ---------------------------------------------------------------------- the stand-in


def test_the_stand_in_checks_the_sigv4_signature_and_speaks_ec2_xml(ec2: Ec2Emulator) -> None:
    body = b"Action=DescribeInstances&Version=2016-11-15"
    unsigned = urllib.request.Request(ec2.url + "/", data=body, method="POST", headers={
        "Content-Type": "application/x-www-form-urlencoded; charset=utf-8"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(unsigned, timeout=5)
    text = refused.value.read().decode()
    assert refused.value.code == 401
    assert "<Response><Errors><Error><Code>AuthFailure</Code>" in text
    assert "<RequestID>" in text

    import botocore.session
    session = botocore.session.Session()
    client = session.create_client("ec2", region_name="us-east-2", endpoint_url=ec2.url)
    answer = client.describe_instances(InstanceIds=[ec2.instance_id])
    instance = answer["Reservations"][0]["Instances"][0]
    assert instance["CapacityReservationId"] == "cr-0a1b2c3d4e5f60718"
    assert instance["InstanceLifecycle"] == "capacity-block"
    other = session.create_client("ec2", region_name="eu-west-1", endpoint_url=ec2.url)
    with pytest.raises(Exception, match="AuthFailure"):  # signed for another region
        other.describe_instances(InstanceIds=[ec2.instance_id])


def test_the_stand_in_control_verbs(ec2: Ec2Emulator) -> None:
    def control(verb: str, body: bytes) -> Any:
        request = urllib.request.Request(f"{ec2.url}/_emulator/{verb}", data=body,
                                         method="POST")
        return get_json_response(request)

    state = control("capacity-block", b'{"ends_in_seconds": 7200}')
    assert state["reservation"]["type"] == "capacity-block"
    source = source_for(ec2)
    first = source.poll().expires_at_unix
    assert first is not None and 5300 < first - time.time() <= 5400
    control("extend", b'{"seconds": 3600}')
    assert source.poll().expires_at_unix == pytest.approx(first + 3600, abs=0.01)
    control("api-fault", b'{"kind": "throttle", "count": 1}')
    with pytest.raises(SourceError, match="RequestLimitExceeded"):
        source.poll()
    control("capacity-block", b'{"type": null}')
    with pytest.raises(SourceAbsent):
        source_for(ec2).poll()


def get_json_response(request: urllib.request.Request) -> Any:
    import json
    with urllib.request.urlopen(request, timeout=5) as response:
        return json.loads(response.read())


# ---------------------------------------------------------------------- the spec


def test_the_spec_is_adaptive_in_the_api_budget_optional_and_probed_by_auto() -> None:
    traits = spec(NAME).traits
    assert traits.adaptive and traits.api_budget and traits.optional
    assert NAME in auto_candidates()
    settings = load_settings({"source": ["capacity-block"]},
                             environ={"ESI_SIDECAR_AWS_EC2_ENDPOINT": "http://127.0.0.1:9/"})
    assert settings.sources == (NAME,)
    assert settings.source_options["aws_ec2_endpoint"] == "http://127.0.0.1:9"


def test_ec2_calls_per_host_hour_on_the_adaptive_schedule() -> None:
    """What the poller plans for this source (the schedule's own function, the default
    30 s --poll-interval): the figures docs/sources.md quotes."""
    def calls_per_hour(block_hours: float) -> tuple[int, collections.Counter[int]]:
        deadline = block_hours * 3600 - TERMINATION_LEAD_SECONDS
        moment, calls = 0.0, []
        while moment < deadline:
            calls.append(moment)
            moment += adaptive_interval(deadline - moment, 30.0)
        return len(calls), collections.Counter(int(c // 3600) for c in calls)

    total, hourly = calls_per_hour(24)
    assert hourly[0] == 4  # the end a day away: one call every 15 minutes
    assert total == 141  # a one-day block: 6 calls per host-hour on average
    assert hourly[23] >= 30  # the final 15 minutes: every 30 s
    two_weeks, _ = calls_per_hour(14 * 24)
    assert two_weeks / (14 * 24 - 0.5) < 4.2


# ---------------------------------------------------------------------- the daemon


def test_the_daemon_serves_the_block_end_and_its_extension_as_a_renewal(
        ec2: Ec2Emulator) -> None:
    end = int(time.time()) + 40 * 60  # served 10 min ahead: polled every --poll-interval
    ec2.set_block_end(end)
    with serve_daemon(**daemon_settings(ec2, poll_schedule="adaptive")) as daemon:
        wait_for(lambda: expiry(daemon)["expires_at_unix"] == end - 1800)
        status, health = get_json(daemon.url + "/healthz")
        assert status == 200 and health["sources"][NAME]["error"] is None
        # The latency from a new end on the stand-in to the daemon serving it.
        moved = end + 60
        changed = time.monotonic()
        ec2.set_block_end(moved)
        wait_for(lambda: expiry(daemon)["expires_at_unix"] == moved - 1800, interval=0.005)
        latency = time.monotonic() - changed
        extended = ec2.extend_block(3600)  # a renewal: served later, not kept earlier
        wait_for(lambda: expiry(daemon)["expires_at_unix"] == extended - 1800, timeout=10)
        body = expiry(daemon)
        metrics = urllib.request.urlopen(daemon.url + "/metrics", timeout=5).read().decode()
    print(f"aws-capacity-block: end moved on the stand-in -> served in {latency * 1000:.0f} ms "
          "(--poll-interval 0.3 s)")
    assert latency < 0.3 * 1.1 + 0.5  # one poll gap, slack for a busy host
    assert body["source"] == NAME and body["kind"] == KIND_SCHEDULED_RELEASE
    assert body["instance_id"] == "i-0123456789abcdef0" and body["error"] is None
    assert 'esi_sidecar_polls_total{outcome="ok",source="aws-capacity-block"}' in metrics
    assert 'esi_sidecar_source_running{source="aws-capacity-block"} 1.0' in metrics


@pytest.mark.parametrize("fault", ["throttle", "status", "garbage", "hang"])
def test_a_failing_ec2_api_never_hides_another_sources_deadline(
        ec2: Ec2Emulator, fault: str) -> None:
    deadline = int(time.time()) + 3600
    ec2.api_fail(fault, count=1000, seconds=6.0)
    with serve_daemon(**daemon_settings(ec2, NAME, "static",
                                        expires_at=str(deadline))) as daemon:
        wait_for(lambda: get_json(daemon.url + "/healthz")[1]["sources"].get(
            NAME, {}).get("consecutive_failures", 0) >= 1, timeout=15)
        body = expiry(daemon)
        health = get_json(daemon.url + "/healthz")[1]
        metrics = urllib.request.urlopen(daemon.url + "/metrics", timeout=5).read().decode()
        ec2.clear_faults()
    assert body["expires_at_unix"] == deadline and body["source"] == "static"
    assert body["error"].startswith(f"{NAME}: DescribeInstances: ")
    expected = {"throttle": "RequestLimitExceeded", "status": "InternalError",
                "garbage": "malformed response", "hang": "no answer"}[fault]
    assert expected in health["sources"][NAME]["error"]
    outcome = "throttled" if fault == "throttle" else "error"
    assert f'esi_sidecar_polls_total{{outcome="{outcome}",source="{NAME}"}} 0.0' not in metrics


def test_wrong_credentials_degrade_health_with_the_reason(
        ec2: Ec2Emulator, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret")
    with serve_daemon(**daemon_settings(ec2)) as daemon:
        # Degraded at once when refused (waiting mends nothing), with the refusal.
        status, health = wait_for(lambda: (lambda answer: "AuthFailure" in str(
            answer[1].get("reason")) and answer)(get_json(daemon.url + "/healthz")))
    assert status == 503 and health["status"] == "degraded"
    assert health["reason"].startswith(f"{NAME}: ")
    assert "AuthFailure" in health["sources"][NAME]["error"]


def _auto(ec2: Ec2Emulator, dead: str) -> dict[str, Any]:
    settings: dict[str, Any] = {name: dead for name in URL_SETTINGS}
    settings.update(daemon_settings(ec2, "auto"))
    return settings


def test_auto_runs_it_beside_the_aws_source_and_the_earliest_wins(
        ec2: Ec2Emulator, unused_port: int) -> None:
    end = int(time.time()) + 86400
    ec2.set_block_end(end)
    with serve_daemon(**_auto(ec2, f"http://127.0.0.1:{unused_port}")) as daemon:
        wait_for(lambda: expiry(daemon)["source"] == NAME)
        spot = int(time.time()) + 120
        ec2.interrupt(spot)  # a spot-style notice on the same instance: earlier, it wins
        wait_for(lambda: expiry(daemon)["expires_at_unix"] == spot)
        body = expiry(daemon)
        health = get_json(daemon.url + "/healthz")[1]
    assert sorted(health["sources"]) == ["aws", NAME]
    assert [n["source"] for n in body["notices"]] == ["aws", NAME]
    assert body["notices"][1]["expires_at_unix"] == end - 1800


@pytest.mark.parametrize(("unset", "reservation", "reason"), [
    (True, "capacity-block", "refused: no AWS credentials"),
    (False, None, "not in a Capacity Block"),
    (False, "default", "not a Capacity Block"),
])
def test_auto_skips_it_with_one_clear_line_and_the_aws_source_runs(
        ec2: Ec2Emulator, monkeypatch: pytest.MonkeyPatch, unused_port: int, unset: bool,
        reservation: Any, reason: str) -> None:
    if unset:
        monkeypatch.delenv("AWS_ACCESS_KEY_ID")
        monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    ec2.set_reservation(reservation)
    with serve_daemon(**_auto(ec2, f"http://127.0.0.1:{unused_port}")) as daemon:
        # Skipped, and the daemon healthy on the aws source alone.
        health = wait_for(lambda: (lambda answer: answer[0] == 200 and NAME in answer[1][
            "skipped"] and answer[1])(get_json(daemon.url + "/healthz")), timeout=15)
    assert reason in health["skipped"][NAME]
    assert list(health["sources"]) == ["aws"]


def test_a_far_block_end_is_polled_rarely_and_stays_fresh(ec2: Ec2Emulator) -> None:
    ec2.set_block_end(time.time() + 86400)  # a day away: the next poll is 15 min later
    with serve_daemon(**daemon_settings(ec2, stale_after=1.0,
                                        poll_schedule="adaptive")) as daemon:
        wait_for(lambda: expiry(daemon)["source"] == NAME)
        started = time.monotonic()
        wait_for(lambda: time.monotonic() - started > 2.0, interval=0.2)
        status, health = get_json(daemon.url + "/healthz")
        body = expiry(daemon)
    assert status == 200 and health["status"] == "ok"
    assert body["stale"] is False  # fresh until the planned poll, not --stale-after
    assert ec2.api_calls("DescribeCapacityReservations") == 1
    assert ec2.api_calls("DescribeInstances") == 1


def test_an_extension_after_the_final_save_resumes_the_guarded_loop(
        ec2: Ec2Emulator, caplog: pytest.LogCaptureFixture) -> None:
    """The renewal as the training side meets it: saved for the block's end, waiting in
    should_stop(), then the block is extended and training goes on in the same process."""
    import logging
    import threading

    from sidecar.train.client import SidecarClient
    from sidecar.train.guard import CheckpointGuard
    from sidecar.train.policy import SavePolicy

    caplog.set_level(logging.INFO, logger="sidecar.train.guard")
    ec2.set_block_end(time.time() + TERMINATION_LEAD_SECONDS + 4)  # EC2 acts in 4 s
    steps: list[int] = []
    saves: list[int] = []
    outcome: dict[str, Any] = {}
    with serve_daemon(**daemon_settings(ec2, poll_interval=0.2)) as daemon:
        wait_for(lambda: expiry(daemon)["source"] == NAME)
        guard = CheckpointGuard(SidecarClient(daemon.url),
                                SavePolicy(save_seconds=0.5, redundant_seconds=1.5),
                                refresh_seconds=0.1, environ={})

        def loop() -> None:
            try:
                for step in range(10_000):
                    with guard.step():
                        time.sleep(0.2)
                    steps.append(step)
                    if guard.should_save():
                        with guard.saving(step):
                            saves.append(step)
                    if guard.should_stop():
                        outcome["stopped"] = time.time()
                        return
            except BaseException as exc:  # reported to the test
                outcome["error"] = exc

        thread = threading.Thread(target=loop, daemon=True)
        thread.start()
        wait_for(lambda: saves or outcome, timeout=15)
        saved_step = saves[0]
        wait_for(lambda: steps and steps[-1] == saved_step, timeout=5)
        ec2.extend_block(4)  # extended: EC2 now acts 4 s later than it would have
        wait_for(lambda: steps[-1] > saved_step or outcome, timeout=10)
        assert "error" not in outcome and "stopped" not in outcome  # training goes on
        thread.join(20)
    assert not thread.is_alive() and "error" not in outcome
    assert len(saves) == 2 and saves[1] > saved_step  # a final save for the new end too
    assert guard.released is True
    assert any("the release moved later" in r.getMessage() for r in caplog.records)


def test_a_loopback_ec2_endpoint_is_the_emulator_polled_fast_without_a_budget() -> None:
    emulated = load_settings({"source": [NAME], "poll_interval": "0.5"},
                             environ={"ESI_SIDECAR_AWS_EC2_ENDPOINT": "http://127.0.0.1:9001"})
    assert emulated.poll_interval == 0.5 and emulated.effective_max_api_rate is None
    from sidecar.host.settings import ConfigError
    with pytest.raises(ConfigError, match="where a cloud API is polled"):
        load_settings({"source": [NAME], "poll_interval": "1"}, environ={})
    assert load_settings({"source": [NAME]}, environ={}).effective_max_api_rate == 720.0
