"""The volcengine-spot source against the Volcengine emulator's metadata service on
127.0.0.1 (404 until a spot notice, then the reclaim time as text), and through the real
daemon: alone and under ``auto`` with no credentials set, and next to the ESI release,
whose deadline a failing spot path never hides."""

from __future__ import annotations

import time
import urllib.request
from collections.abc import Iterator
from datetime import timedelta, timezone
from typing import Any

import pytest
from daemon_harness import get_json, serve_daemon, wait_for

from sidecar.host.sources.base import SourceError
from sidecar.host.sources.registry import auto_candidates, spec
from sidecar.host.sources.volcengine_spot import (
    POLL_INTERVAL_SECONDS,
    SpotTerminationSource,
    read_termination_time,
)
from sidecar.models import KIND_PREEMPTION, KIND_SCHEDULED_RELEASE
from sidecar.tools.emulator import Emulator

AK = "AKLTspottest00000001"
SK = "spot-test-secret-xyz"
URL_SETTINGS = ("metadata_url", "aws_imds_url", "gcp_metadata_url", "azure_metadata_url")
# 2026-12-01T10:00:00Z, the instant every format below names.
WHEN = 1796119200.0


@pytest.fixture(autouse=True)
def _no_credentials(monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    for name in ("VOLCENGINE_ACCESS_KEY", "VOLCENGINE_SECRET_KEY", "VOLCENGINE_SESSION_TOKEN",
                 "HTTP_PROXY", "http_proxy", "HTTPS_PROXY", "https_proxy"):
        monkeypatch.delenv(name, raising=False)
    # The SDK's credential chain must not ask a real metadata address for a role.
    monkeypatch.setenv("VOLCENGINE_ECS_METADATA_DISABLED", "true")
    monkeypatch.setenv("VOLCENGINE_CLI_CONFIG_FILE", str(tmp_path / "absent.json"))


@pytest.fixture
def emu() -> Iterator[Emulator]:
    with Emulator(access_key=AK, secret_key=SK) as emulator:
        yield emulator


def expiry(daemon: Any) -> Any:
    return get_json(daemon.url + "/v1/expiry")[1]


# ---------------------------------------------------------------------- the source


def test_no_notice_is_a_healthy_poll_without_a_deadline(emu: Emulator) -> None:
    observation = SpotTerminationSource(emu.url).poll()
    assert observation.expires_at_unix is None and observation.notices == ()
    assert observation.instance_id == "i-emu0001"


def test_a_spot_notice_is_a_preemption_deadline_and_goes_at_404(emu: Emulator) -> None:
    source = SpotTerminationSource(emu.url)
    served = emu.raise_spot_notice(300)
    observation = source.poll()
    assert observation.kind == KIND_PREEMPTION
    assert observation.expires_at_unix is not None
    assert 290 < observation.expires_at_unix - time.time() <= 300
    assert observation.notices[0].detail == f"spot reclaim at {served}"
    assert observation.assumed_timezone is None  # the guide's format carries its zone
    emu.clear_spot_notice()
    assert source.poll().expires_at_unix is None


@pytest.mark.parametrize(
    ("text", "zone"),
    [
        ("2026-12-01T10:00:00Z", None),  # UTC, as the guide shows it
        ("2026-12-01T10:00:00.000Z", None),
        ("2026-12-01 10:00:00Z", None),
        ("2026-12-01T18:00:00+08:00", None),  # as the OpenAPI writes times
        ("2026-12-01 18:00:00 +0800", None),
        ("1796119200", None),  # Unix seconds
        ("2026-12-01 18:00:00", "UTC+08:00"),  # naive: UTC+8 when that is plausible
        ("2026-12-01T18:00:00", "UTC+08:00"),
        ("2026-12-01 10:00:00", "UTC"),  # naive UTC: read as UTC+8 it is 8 h past
    ],
)
def test_every_time_format_names_the_same_instant(emu: Emulator, text: str,
                                                  zone: Any) -> None:
    source = SpotTerminationSource(emu.url, clock=lambda: WHEN - 300)
    emu.raise_spot_notice(text=text + "\n")
    observation = source.poll()
    assert observation.expires_at_unix == WHEN
    assert observation.assumed_timezone == zone


def test_a_naive_time_is_read_in_the_earliest_plausible_zone() -> None:
    # Five minutes ahead in Beijing time: UTC+8, never 8 h late as UTC.
    assert read_termination_time("2026-12-01 18:00:00", WHEN - 300).unix == WHEN
    # Just passed in UTC+8 (a late poll) is still plausible: UTC+8, the earlier reading.
    assert read_termination_time("2026-12-01 18:00:00", WHEN + 600).unix == WHEN
    # Long past in either zone: the earlier reading, a deadline that passed.
    assert read_termination_time("2026-12-01 18:00:00", WHEN + 86400).unix == WHEN
    # --timezone is taken as given.
    utc = read_termination_time("2026-12-01 18:00:00", WHEN, timezone.utc)
    assert utc.unix == WHEN + 8 * 3600 and utc.assumed_timezone == "UTC"
    west = timezone(timedelta(hours=-5))
    assert read_termination_time("2026-12-01 05:00:00", WHEN, west).unix == WHEN


@pytest.mark.parametrize(
    ("kind", "delay", "message"),
    [
        ("spot-down", 0.0, "HTTP 500"),
        ("spot-garbage", 0.0, "not a timestamp"),
        ("spot-slow", 5.0, "no answer within 1.5 s"),
        ("spot-trickle", 0.3, "no answer within 1.5 s"),
    ],
)
def test_faults_are_one_line_errors_within_one_request_bound(
    emu: Emulator, kind: str, delay: float, message: str
) -> None:
    source = SpotTerminationSource(emu.url)
    emu.raise_spot_notice(300)
    emu.inject_fault(kind, 1, delay)
    started = time.monotonic()
    with pytest.raises(SourceError, match=message) as failed:
        source.poll()
    assert time.monotonic() - started < 2.5  # one bounded request (1.5 s), not the fault's
    assert "\n" not in str(failed.value)
    assert source.poll().kind == KIND_PREEMPTION  # and the next poll is fine


@pytest.mark.parametrize("text", ["", "soon", "1970-01-01T00:00:00Z", "x" * 400])
def test_an_answer_that_is_not_a_time_is_an_error(emu: Emulator, text: str) -> None:
    emu.raise_spot_notice(text=text)
    with pytest.raises(SourceError):
        SpotTerminationSource(emu.url).poll()


def test_no_metadata_service_fails_fast(unused_port: int) -> None:
    started = time.monotonic()
    with pytest.raises(SourceError, match="cannot connect: not on Volcengine ECS"):
        SpotTerminationSource(f"http://127.0.0.1:{unused_port}").poll()
    assert time.monotonic() - started < 1.0


def test_the_spec_polls_on_its_own_cadence_without_the_api_budget() -> None:
    declared = spec("volcengine-spot")
    assert declared.traits.poll_interval_seconds == POLL_INTERVAL_SECONDS
    assert POLL_INTERVAL_SECONDS * 1.1 < 2.0  # jittered, still a poll every 2 s at most
    assert not declared.traits.api_budget and not declared.traits.adaptive
    assert "volcengine-spot" in auto_candidates()


def test_the_emulator_control_verb_raises_and_clears_the_notice(emu: Emulator) -> None:
    def control(body: bytes, method: str = "POST") -> Any:
        request = urllib.request.Request(emu.url + "/_emulator/spot", data=body,
                                         method=method)
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.read()

    control(b'{"in_seconds": 120}')
    assert SpotTerminationSource(emu.url).poll().kind == KIND_PREEMPTION
    control(b'{"termination_time": "2026-12-01 10:00:00"}')
    assert emu.snapshot()["spot_termination_time"] == "2026-12-01 10:00:00"
    control(b"", method="DELETE")
    assert SpotTerminationSource(emu.url).poll().expires_at_unix is None
    with pytest.raises(urllib.error.HTTPError) as refused:
        control(b'{"in_seconds": "soon"}')
    assert refused.value.code == 400


# ---------------------------------------------------------------------- the daemon


def served_within(daemon: Any, emu: Emulator) -> float:
    """Raise a notice on the emulator; seconds until /v1/expiry serves it."""
    wait_for(lambda: get_json(daemon.url + "/healthz")[1]["sources"].get(
        "volcengine-spot", {}).get("last_success_age_seconds") is not None)
    raised = time.monotonic()
    emu.raise_spot_notice(300)
    wait_for(lambda: expiry(daemon)["kind"] == KIND_PREEMPTION, timeout=10, interval=0.005)
    return time.monotonic() - raised


def test_the_daemon_serves_a_reclaim_within_2_s_without_credentials(emu: Emulator) -> None:
    with serve_daemon(sources=("volcengine-spot",), metadata_url=emu.url,
                      poll_interval=30.0) as daemon:
        wait_for(lambda: daemon.store.health().ok)
        status, health = get_json(daemon.url + "/healthz")
        assert status == 200 and health["sources"]["volcengine-spot"]["error"] is None
        assert expiry(daemon)["expires_at"] is None and expiry(daemon)["error"] is None
        latency = served_within(daemon, emu)
        body = expiry(daemon)
        metrics = urllib.request.urlopen(daemon.url + "/metrics", timeout=5).read().decode()
    assert latency < 2.0 + 0.3  # one poll gap (< 2 s with jitter), slack for a busy host
    assert body["source"] == "volcengine-spot" and body["instance_id"] == "i-emu0001"
    assert 290 < body["remaining_seconds"] <= 300
    assert emu.request_count() == 0  # no OpenAPI call
    assert 'esi_sidecar_polls_total{outcome="ok",source="volcengine-spot"}' in metrics
    assert 'esi_sidecar_consecutive_failures{source="volcengine-spot"} 0.0' in metrics


def test_auto_runs_it_with_no_credentials_and_serves_the_reclaim(
    emu: Emulator, unused_port: int
) -> None:
    settings: dict[str, Any] = {name: f"http://127.0.0.1:{unused_port}"
                                for name in URL_SETTINGS}
    settings.update(sources=("auto",), metadata_url=emu.url, api_endpoint=emu.url,
                    poll_interval=30.0)
    with serve_daemon(**settings) as daemon:
        wait_for(lambda: "volcengine-spot" in get_json(daemon.url + "/healthz")[1]["sources"])
        latency = served_within(daemon, emu)
        body = expiry(daemon)
        health = wait_for(lambda: (lambda h: h["sources"].get("volcengine-esi", {}).get(
            "error") and h)(get_json(daemon.url + "/healthz")[1]))
    assert latency < 2.0 + 0.3
    assert body["source"] == "volcengine-spot"
    assert health["sources"]["volcengine-spot"]["error"] is None
    # The OpenAPI sources run too (their probe is the same metadata service) and say
    # plainly what they lack; they do not hide the reclaim.
    assert "no Volcengine credentials" in str(health["sources"]["volcengine-esi"])


@pytest.mark.parametrize(
    ("kind", "delay"),
    [("spot-down", 0.0), ("spot-garbage", 0.0), ("spot-slow", 5.0), ("spot-trickle", 0.3)],
)
def test_a_failing_spot_path_never_hides_the_esi_release(
    emu: Emulator, monkeypatch: pytest.MonkeyPatch, kind: str, delay: float
) -> None:
    monkeypatch.setenv("VOLCENGINE_ACCESS_KEY", AK)
    monkeypatch.setenv("VOLCENGINE_SECRET_KEY", SK)
    emu.set_release_in(600)
    emu.inject_fault(kind, None, delay)  # until cleared
    with serve_daemon(sources=("volcengine-esi", "volcengine-spot"), api_endpoint=emu.url,
                      metadata_url=emu.url, poll_interval=0.2) as daemon:
        wait_for(lambda: get_json(daemon.url + "/healthz")[1]["sources"].get(
            "volcengine-spot", {}).get("consecutive_failures", 0) >= 1, timeout=10)
        wait_for(lambda: expiry(daemon)["source"] is not None, timeout=10)
        body = expiry(daemon)
        health = get_json(daemon.url + "/healthz")[1]
        assert body["kind"] == KIND_SCHEDULED_RELEASE and body["source"] == "volcengine-esi"
        assert 500 < body["remaining_seconds"] <= 600  # served (stale: a source fails)
        assert health["sources"]["volcengine-esi"]["error"] is None
        assert "metadata service" in health["sources"]["volcengine-spot"]["error"]
        # Once the spot path mends, its earlier reclaim wins.
        emu.clear_faults()
        emu.raise_spot_notice(300)
        wait_for(lambda: expiry(daemon)["source"] == "volcengine-spot", timeout=10)
        assert [n["source"] for n in expiry(daemon)["notices"]] == ["volcengine-spot",
                                                                    "volcengine-esi"]
