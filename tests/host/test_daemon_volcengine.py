"""The whole chain: daemon -> real Volcengine SDK over HTTP -> emulator, and back to curl.

Faults are injected in the emulator (the cloud); the daemon must keep serving the last
good deadline, report stale/degraded, and recover when the fault clears.
"""

from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import RunningDaemon, get_json, serve_daemon, wait_for

from sidecar.tools.emulator import Emulator

ACCESS_KEY = "AKLTtestaccesskey0001"
SECRET_KEY = "c2VjcmV0LXNlY3JldC1zZWNyZXQ="
INSTANCE = "i-test0001"
SCHEDULED = "esi-test0001"


@pytest.fixture
def emulator(monkeypatch: pytest.MonkeyPatch) -> Iterator[Emulator]:
    monkeypatch.setenv("VOLCENGINE_ACCESS_KEY", ACCESS_KEY)
    monkeypatch.setenv("VOLCENGINE_SECRET_KEY", SECRET_KEY)
    monkeypatch.delenv("VOLCENGINE_SESSION_TOKEN", raising=False)
    with Emulator(
        access_key=ACCESS_KEY, secret_key=SECRET_KEY, region="cn-beijing",
        instance_id=INSTANCE, scheduled_instance_id=SCHEDULED, auto_release_at=None,
    ) as emu:
        emu.set_release_in(3600)
        yield emu


@contextmanager
def daemon_for(emu: Emulator, **overrides: Any) -> Iterator[RunningDaemon]:
    settings: dict[str, Any] = {
        "sources": ("volcengine-esi",), "api_endpoint": emu.url, "metadata_url": emu.url,
        "poll_interval": 0.2, "stale_after": 1.0,
    }
    settings.update(overrides)
    with serve_daemon(**settings) as daemon:
        yield daemon


def expiry(daemon: RunningDaemon) -> dict[str, Any]:
    return get_json(daemon.url + "/v1/expiry")[1]


def healthy(daemon: RunningDaemon) -> bool:
    return get_json(daemon.url + "/healthz")[0] == 200


def test_emulated_release_is_served_with_ids_from_metadata(emulator: Emulator) -> None:
    release = emulator.set_release_in(1800)
    with daemon_for(emulator) as daemon:
        wait_for(lambda: healthy(daemon))
        body = expiry(daemon)
        assert body["source"] == "volcengine-esi"
        assert body["kind"] == "scheduled-release"
        assert body["instance_id"] == INSTANCE
        assert body["scheduled_instance_id"] == SCHEDULED
        assert body["expires_at_unix"] == pytest.approx(
            time.mktime(time.strptime(release[:19], "%Y-%m-%dT%H:%M:%S")) - time.timezone
            - 8 * 3600, abs=1)
        assert 1790 < body["remaining_seconds"] <= 1800
        # The worked example from the docs, on an emulated release 200 s ahead.
        emulator.set_release_in(200)
        wait_for(lambda: expiry(daemon)["remaining_seconds"] < 201)
        _, decision = get_json(daemon.url + "/v1/decision?step_seconds=80")
        assert decision["save_now"] is True and decision["budget_seconds"] == 260


def test_deadline_moved_earlier_and_later_is_served_after_the_next_poll(
    emulator: Emulator,
) -> None:
    with daemon_for(emulator) as daemon:
        wait_for(lambda: healthy(daemon))
        first = expiry(daemon)["expires_at_unix"]
        emulator.set_release_in(600)  # brought forward
        earlier = wait_for(lambda: expiry(daemon)["expires_at_unix"] < first - 2000 and expiry(
            daemon)["expires_at_unix"])
        emulator.set_release_in(7200)  # renewed
        later = wait_for(lambda: expiry(daemon)["expires_at_unix"] > first + 2000 and expiry(
            daemon)["expires_at_unix"])
        assert earlier < first < later


def test_scheduled_instance_id_looked_up_once(emulator: Emulator) -> None:
    with daemon_for(emulator) as daemon:
        wait_for(lambda: emulator.request_count("DescribeScheduledInstances") >= 5)
        assert healthy(daemon)
    assert emulator.request_count("DescribeInstances") == 1


@pytest.mark.parametrize(
    "fault", ["throttle", "flow-limit", "server-error", "malformed-json", "bad-release", "auth"]
)
def test_each_fault_keeps_last_good_value_degrades_and_recovers(
    emulator: Emulator, fault: str
) -> None:
    with daemon_for(emulator) as daemon:
        wait_for(lambda: healthy(daemon))
        good = expiry(daemon)["expires_at_unix"]
        emulator.inject_fault(fault)
        body = wait_for(lambda: (lambda b: b["error"] and b)(expiry(daemon)))
        assert body["expires_at_unix"] == good  # the last good deadline is still served
        assert "\n" not in body["error"]
        wait_for(lambda: not healthy(daemon), timeout=15)
        status, health = get_json(daemon.url + "/healthz")
        assert status == 503 and health["status"] == "degraded"
        stale = expiry(daemon)
        assert stale["stale"] is True and stale["expires_at_unix"] == good
        emulator.clear_faults()
        wait_for(lambda: healthy(daemon), timeout=15)
        recovered = expiry(daemon)
        assert recovered["error"] is None and recovered["stale"] is False


def test_throttling_is_counted_apart_in_metrics(emulator: Emulator) -> None:
    with daemon_for(emulator) as daemon:
        wait_for(lambda: healthy(daemon))
        emulator.inject_fault("throttle", count=1)
        wait_for(lambda: 'outcome="throttled",source="volcengine-esi"} 1.0' in
                 urllib.request.urlopen(daemon.url + "/metrics").read().decode())


def test_slow_api_times_out_without_stalling_the_http_api(emulator: Emulator) -> None:
    with daemon_for(emulator) as daemon:
        wait_for(lambda: healthy(daemon))
        emulator.inject_fault("slow", delay=6.0)  # past the 5 s SDK timeouts
        started = time.monotonic()
        body = expiry(daemon)
        assert time.monotonic() - started < 1  # the API reads the store, never the cloud
        assert body["expires_at_unix"] is not None
        body = wait_for(lambda: (lambda b: b["error"] and b)(expiry(daemon)), timeout=20)
        assert "timed out" in body["error"].lower() or "timeout" in body["error"].lower()
        emulator.clear_faults()


@pytest.mark.parametrize("fault", ["non-esi", "empty-release"])
def test_no_scheduled_release_is_null_and_healthy(emulator: Emulator, fault: str) -> None:
    emulator.inject_fault(fault)
    with daemon_for(emulator) as daemon:
        wait_for(lambda: healthy(daemon))
        body = expiry(daemon)
        assert body["expires_at"] is None and body["remaining_seconds"] is None
        assert body["error"] is None and body["stale"] is False
        assert body["instance_id"] == INSTANCE


def test_metadata_down_without_configured_ids_is_an_error_then_recovers(
    emulator: Emulator,
) -> None:
    emulator.inject_fault("metadata-down")
    with daemon_for(emulator) as daemon:
        body = wait_for(lambda: (lambda b: b["error"] and b)(expiry(daemon)), timeout=20)
        assert "metadata" in body["error"].lower()
        emulator.clear_faults()
        wait_for(lambda: healthy(daemon), timeout=20)


def test_configured_ids_skip_metadata_and_describe_instances(emulator: Emulator) -> None:
    with daemon_for(emulator, instance_id=INSTANCE, scheduled_instance_id=SCHEDULED,
                    region="cn-beijing", metadata_url="http://127.0.0.1:9") as daemon:
        wait_for(lambda: healthy(daemon))
    assert emulator.request_count("DescribeInstances") == 0
    assert emulator.metadata_request_count() == 0


def test_restart_with_state_file_serves_last_good_value_while_the_api_is_down(
    emulator: Emulator, tmp_path: Path
) -> None:
    state = tmp_path / "state.json"
    with daemon_for(emulator, state_file=state) as daemon:
        wait_for(lambda: healthy(daemon))
        good = expiry(daemon)["expires_at_unix"]
    emulator.inject_fault("server-error")
    with daemon_for(emulator, state_file=state) as daemon:
        body = expiry(daemon)
        assert body["expires_at_unix"] == good and body["stale"] is True
        emulator.clear_faults()
        wait_for(lambda: healthy(daemon), timeout=15)
        assert expiry(daemon)["stale"] is False


def test_secrets_never_reach_logs_responses_or_the_state_file(
    emulator: Emulator, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    state = tmp_path / "state.json"
    with daemon_for(emulator, state_file=state) as daemon:
        wait_for(lambda: healthy(daemon))
        emulator.inject_fault("auth")
        wait_for(lambda: expiry(daemon)["error"])
        seen = [json.dumps(expiry(daemon)), json.dumps(get_json(daemon.url + "/healthz")[1]),
                urllib.request.urlopen(daemon.url + "/metrics").read().decode()]
        emulator.clear_faults()
    seen += [caplog.text, state.read_text()]
    for text in seen:
        assert SECRET_KEY not in text
        assert ACCESS_KEY not in text


def test_one_empty_release_time_does_not_erase_a_known_deadline(
    emulator: Emulator, tmp_path: Path
) -> None:
    """An ESI instance does not stop being one between two polls: a single answer with an
    empty AutoReleaseAt keeps the known deadline (and says so); only several polls in a row
    make it gone. The state file never holds the glitch."""
    state = tmp_path / "state.json"
    with daemon_for(emulator, state_file=state) as daemon:
        wait_for(lambda: healthy(daemon))
        known = expiry(daemon)["expires_at_unix"]
        polls = emulator.request_count("DescribeScheduledInstances")
        emulator.inject_fault("empty-release", count=1)
        body = wait_for(lambda: (lambda b: b["error"] and b)(expiry(daemon)), timeout=20)
        assert body["expires_at_unix"] == known and "deadline disappeared" in body["error"]
        wait_for(lambda: expiry(daemon)["error"] is None, timeout=20)  # the next poll had it
        assert expiry(daemon)["expires_at_unix"] == known
        assert emulator.request_count("DescribeScheduledInstances") > polls + 1
        saved = json.loads(state.read_text())["sources"]["volcengine-esi"]["observation"]
        assert saved["expires_at_unix"] == known  # the glitch never reached the state file

        emulator.inject_fault("empty-release")  # for good: gone after the confirmations
        gone = wait_for(lambda: (lambda b: b["expires_at"] is None and b)(expiry(daemon)),
                        timeout=20)
        assert gone["error"] is None and gone["stale"] is False
        emulator.clear_faults()
