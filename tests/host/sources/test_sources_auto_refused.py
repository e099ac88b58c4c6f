"""A refusal that asking again will not change: an optional source under ``--source
auto`` is skipped with the reason (issue 22, item 7); a source named explicitly, or the
ESI source itself, stays an error, degraded at once (issue 26, item 4). The real daemon,
the real SDK over HTTP, the emulator answering as the service does."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from daemon_harness import RunningDaemon, get_json, serve_daemon, wait_for

from sidecar.tools.emulator import Emulator

ACCESS_KEY = "AKLTtestaccesskey0001"
SECRET_KEY = "c2VjcmV0LXNlY3JldC1zZWNyZXQ="
OTHER_CLOUDS = ("aws_imds_url", "gcp_metadata_url", "azure_metadata_url")
# fault -> what the service answers: (HTTP status, Volcengine error code)
REFUSALS = {"forbidden": (403, "AccessDenied"), "invalid-action": (400, "InvalidAction")}


@pytest.fixture
def emulator(monkeypatch: pytest.MonkeyPatch) -> Iterator[Emulator]:
    monkeypatch.setenv("VOLCENGINE_ACCESS_KEY", ACCESS_KEY)
    monkeypatch.setenv("VOLCENGINE_SECRET_KEY", SECRET_KEY)
    monkeypatch.delenv("VOLCENGINE_SESSION_TOKEN", raising=False)
    with Emulator(access_key=ACCESS_KEY, secret_key=SECRET_KEY, region="cn-beijing",
                  instance_id="i-refused01", scheduled_instance_id="esi-refused01",
                  auto_release_at=None) as emu:
        emu.set_release_in(3600)
        yield emu


@contextmanager
def daemon_for(emu: Emulator, dead_url: str, **overrides: Any) -> Iterator[RunningDaemon]:
    settings: dict[str, Any] = {name: dead_url for name in OTHER_CLOUDS}
    settings.update(sources=("auto",), api_endpoint=emu.url, metadata_url=emu.url,
                    poll_interval=0.2, stale_after=30.0)
    settings.update(overrides)
    with serve_daemon(**settings) as daemon:
        yield daemon


@pytest.fixture
def dead_url(unused_port: int) -> str:
    return f"http://127.0.0.1:{unused_port}"


def health(daemon: RunningDaemon) -> tuple[int, Any]:
    return get_json(daemon.url + "/healthz")


@pytest.mark.parametrize("fault", sorted(REFUSALS))
def test_auto_skips_system_events_the_account_may_not_call_and_serves_the_release_fresh(
        emulator: Emulator, dead_url: str, fault: str) -> None:
    emulator.inject_fault(fault, action="DescribeSystemEvents")
    status_code, error_code = REFUSALS[fault]
    with daemon_for(emulator, dead_url) as daemon:
        wait_for(lambda: "volcengine-events" in health(daemon)[1]["skipped"], timeout=10)
        wait_for(lambda: health(daemon)[0] == 200, timeout=10)
        code, body = health(daemon)
        expiry = get_json(daemon.url + "/v1/expiry")[1]
    reason = body["skipped"]["volcengine-events"]
    assert code == 200 and body["status"] == "ok", body
    assert reason.startswith("refused: DescribeSystemEvents failed: ")
    assert f"HTTP {status_code} {error_code}" in reason
    assert "volcengine-esi" in body["sources"] and "volcengine-events" not in body["sources"]
    assert expiry["stale"] is False and expiry["error"] is None
    assert expiry["source"] == "volcengine-esi" and expiry["kind"] == "scheduled-release"
    assert expiry["expires_at_unix"] is not None
    assert emulator.request_count("DescribeSystemEvents") >= 1  # asked, through the SDK


def test_a_refused_source_is_asked_again_later_and_runs_once_allowed(
        emulator: Emulator, dead_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import sidecar.host.sources.auto as auto

    monkeypatch.setattr(auto, "REPROBE_SECONDS", 0.3)
    emulator.inject_fault("forbidden", action="DescribeSystemEvents")
    with daemon_for(emulator, dead_url) as daemon:
        wait_for(lambda: "volcengine-events" in health(daemon)[1]["skipped"], timeout=10)
        emulator.clear_faults()  # the policy now allows the action
        wait_for(lambda: "volcengine-events" in health(daemon)[1]["sources"], timeout=10)
        body = health(daemon)[1]
    assert "volcengine-events" not in body["skipped"]


def test_a_transient_failure_of_the_optional_source_still_degrades(
        emulator: Emulator, dead_url: str) -> None:
    emulator.inject_fault("server-error", action="DescribeSystemEvents")
    with daemon_for(emulator, dead_url, stale_after=1.0) as daemon:
        wait_for(lambda: health(daemon)[1]["status"] == "degraded", timeout=10)
        code, body = health(daemon)
    assert code == 503 and "volcengine-events" not in body["skipped"]
    assert "InternalError" in body["sources"]["volcengine-events"]["error"]


def test_a_refused_source_named_explicitly_stays_an_error(
        emulator: Emulator, dead_url: str) -> None:
    emulator.inject_fault("forbidden", action="DescribeSystemEvents")
    with daemon_for(emulator, dead_url,
                    sources=("volcengine-esi", "volcengine-events")) as daemon:
        wait_for(lambda: health(daemon)[1]["status"] == "degraded", timeout=10)
        code, body = health(daemon)
        expiry = get_json(daemon.url + "/v1/expiry")[1]
    assert code == 503 and body["skipped"] == {}
    assert "volcengine-events" in body["reason"] and "AccessDenied" in body["reason"]
    assert expiry["stale"] is True


def test_auto_with_the_esi_calls_refused_is_degraded_at_once(
        emulator: Emulator, dead_url: str) -> None:
    emulator.inject_fault("forbidden", action="DescribeScheduledInstances")
    # A long staleness bound: a refusal is degraded at once, never "starting" that long.
    with daemon_for(emulator, dead_url, stale_after=300.0) as daemon:
        wait_for(lambda: health(daemon)[1]["status"] == "degraded", timeout=10)
        code, body = health(daemon)
    assert code == 503 and "volcengine-esi" not in body["skipped"]
    assert body["reason"].startswith("volcengine-esi: ") and "AccessDenied" in body["reason"]


def test_without_credentials_the_daemon_is_degraded_at_once_with_the_reason(
        emulator: Emulator, dead_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VOLCENGINE_ACCESS_KEY")
    monkeypatch.delenv("VOLCENGINE_SECRET_KEY")
    with daemon_for(emulator, dead_url, sources=("volcengine-esi",),
                    stale_after=300.0) as daemon:
        wait_for(lambda: health(daemon)[1]["status"] == "degraded", timeout=15)
        code, body = health(daemon)
    assert code == 503 and "no Volcengine credentials" in body["reason"]
