"""The protection verdict per source, on the real daemon (issue 24, item 2): the emulated
GCP metadata server, a job reporting a 60 s save through POST /v1/events."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from daemon_harness import get_json, serve_daemon, wait_for

from sidecar.host.settings import ConfigError, load_settings
from sidecar.tools.emulator.gcp import GcpMetadataEmulator


@pytest.fixture()
def gce() -> Iterator[GcpMetadataEmulator]:
    with GcpMetadataEmulator() as emulator:
        yield emulator


def post_events(url: str, events: list[dict[str, Any]]) -> None:
    request = urllib.request.Request(url + "/v1/events", data=json.dumps(events).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=5) as response:
        assert response.status == 202


def report_a_60_s_save(url: str, step: int = 1200, saved_ago: float = 41 * 60) -> None:
    now = time.time()
    post_events(url, [
        {"kind": "save-finished", "job": "train:1", "step": step, "seconds": 60.0,
         "save": "routine", "at_unix": now - saved_ago},
        {"kind": "step-estimate", "job": "train:1", "step_seconds": 5.0,
         "save_seconds": 60.0, "budget_seconds": 185.0, "at_unix": now},
    ])


def gcp_verdict(url: str) -> dict[str, Any]:
    status, body = get_json(url + "/v1/protection")
    assert status == 200
    return next(v for v in body["sources"] if v["source"] == "gcp")


def test_a_gcp_preemption_source_with_a_60_s_save_is_not_protected(
        gce: GcpMetadataEmulator, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "sidecar.host.protection")
    with serve_daemon(sources=("gcp",), gcp_metadata_url=gce.url) as daemon:
        wait_for(lambda: daemon.store.health().ok)
        assert gcp_verdict(daemon.url)["status"] == "unknown"  # no job yet
        report_a_60_s_save(daemon.url)
        verdict = wait_for(lambda: (v := gcp_verdict(daemon.url))["status"] != "unknown" and v)
        assert verdict["status"] == "not-protected" and verdict["protected"] is False
        assert verdict["notice_seconds"] == 30.0 and verdict["needed_seconds"] == 65.0
        assert verdict["at_risk_step"] == 1200
        assert 41 * 60 - 5 <= verdict["at_risk_seconds"] <= 41 * 60 + 30
        assert verdict["reason"] == ("gcp: 30 s notice < 65 s step + save: a reclaim now "
                                     "loses the 41 min since step 1200")
        _, body = get_json(daemon.url + "/v1/protection")
        assert body["protected"] is False and body["job"]["save_seconds"] == 60.0

        # Logged once, as a warning, by the daemon's own check (every 5 s).
        def warned() -> list[logging.LogRecord]:
            return [r for r in caplog.records if r.levelno == logging.WARNING
                    and "30 s notice < 65 s" in r.getMessage()]
        wait_for(warned, timeout=15)
        metrics = urllib.request.urlopen(daemon.url + "/metrics", timeout=5).read().decode()
        assert 'esi_sidecar_protected{source="gcp"} 0.0' in metrics
        assert 'esi_sidecar_notice_seconds{source="gcp"} 30.0' in metrics
        assert "esi_sidecar_protection_needed_seconds 65.0" in metrics
        page = urllib.request.urlopen(daemon.url + "/", timeout=5).read().decode()
        assert 'data-status="not-protected"' in page
    assert len(warned()) == 1


def test_notice_overrides_the_sources_own_figure(gce: GcpMetadataEmulator) -> None:
    with serve_daemon(sources=("gcp",), gcp_metadata_url=gce.url,
                      notices={"gcp": 90.0}) as daemon:
        wait_for(lambda: daemon.store.health().ok)
        report_a_60_s_save(daemon.url)
        verdict = wait_for(lambda: (v := gcp_verdict(daemon.url))["status"] != "unknown" and v)
        assert verdict["status"] == "protected" and verdict["notice_seconds"] == 90.0


def test_a_gke_node_is_judged_on_its_pods_15_s() -> None:
    with GcpMetadataEmulator(cluster_name="training-cluster") as gke:
        with serve_daemon(sources=("gcp",), gcp_metadata_url=gke.url) as daemon:
            wait_for(lambda: daemon.store.health().ok)
            report_a_60_s_save(daemon.url)
            verdict = wait_for(
                lambda: (v := gcp_verdict(daemon.url))["status"] != "unknown" and v)
            metrics = urllib.request.urlopen(daemon.url + "/metrics", timeout=5).read().decode()
        with serve_daemon(sources=("gcp",), gcp_metadata_url=gke.url,
                          notices={"gcp": 90.0}) as told:  # --notice still wins
            wait_for(lambda: told.store.health().ok)
            report_a_60_s_save(told.url)
            overridden = wait_for(
                lambda: (v := gcp_verdict(told.url))["status"] != "unknown" and v)
    assert verdict["notice_seconds"] == 15.0 and verdict["status"] == "not-protected"
    assert verdict["reason"].startswith("gcp: 15 s notice < 65 s step + save"), verdict
    assert 'esi_sidecar_notice_seconds{source="gcp"} 15.0' in metrics
    assert overridden["notice_seconds"] == 90.0


def test_a_release_known_ahead_is_protected() -> None:
    with serve_daemon(sources=("static",), expires_at="2030-01-01T00:00:00Z") as daemon:
        report_a_60_s_save(daemon.url)
        status, body = get_json(daemon.url + "/v1/protection")
        assert status == 200 and body["protected"] is True
        assert body["sources"][0]["notice_seconds"] is None


def test_the_top_level_is_the_worst_verdict_and_protected_only_when_every_source_is(
        gce: GcpMetadataEmulator) -> None:
    # docs/protection.md: the top-level ``status`` is the worst source's (not-working,
    # not-protected, unknown, protected); ``protected`` is true only when it is
    # ``protected``. A verdict still unknown (no save time from the job yet) is not a
    # protection: the top level says ``unknown``, not protected (issue 39 item 5 changed
    # this from true).
    with serve_daemon(sources=("static", "gcp"), expires_at="2030-01-01T00:00:00Z",
                      gcp_metadata_url=gce.url) as daemon:

        def statuses() -> dict[str, str]:
            body = get_json(daemon.url + "/v1/protection")[1]
            return {v["source"]: v["status"] for v in body["sources"]}

        wait_for(lambda: statuses() == {"static": "protected", "gcp": "unknown"})
        body = get_json(daemon.url + "/v1/protection")[1]
        assert (body["status"], body["protected"]) == ("unknown", False), body
        report_a_60_s_save(daemon.url)
        wait_for(lambda: statuses()["gcp"] != "unknown")
        body = get_json(daemon.url + "/v1/protection")[1]
        assert statuses() == {"static": "protected", "gcp": "not-protected"}, body
        assert (body["status"], body["protected"]) == ("not-protected", False), body


def closed_url() -> Iterator[str]:
    """A loopback port bound and never listening: a connect is refused at once."""
    import socket

    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{closed.getsockname()[1]}"


refused_metadata = pytest.fixture(closed_url)


def test_a_source_that_never_polled_protects_nothing(refused_metadata: str) -> None:
    # Issue 39, item 5: no credentials, metadata refusing connections: the ESI source
    # never polled once, yet the verdict of a time "known ahead" said protected.
    with serve_daemon(sources=("volcengine-esi",), metadata_url=refused_metadata) as daemon:
        wait_for(lambda: daemon.store.snapshot().sources[0].error is not None)
        status, body = get_json(daemon.url + "/v1/protection")
        page = urllib.request.urlopen(daemon.url + "/", timeout=5).read().decode()
        metrics = urllib.request.urlopen(daemon.url + "/metrics", timeout=5).read().decode()
    assert status == 200
    assert (body["status"], body["protected"]) == ("not-working", False), body
    verdict = body["sources"][0]
    assert (verdict["status"], verdict["protected"], verdict["working"]) == (
        "not-working", None, False), verdict
    assert verdict["reason"].startswith("volcengine-esi: not working (no successful poll "
                                        "yet: metadata service"), verdict
    assert "Connection refused" in verdict["reason"], verdict
    assert 'data-status="not-working"' in page and 'data-status="protected"' not in page
    assert "esi_sidecar_protected{" not in metrics


def test_a_release_long_past_protects_nothing() -> None:
    # A release that came while the machine still runs: the answer (or the clock) is wrong.
    with serve_daemon(sources=("static",), expires_at=repr(time.time() - 3600)) as daemon:
        wait_for(lambda: daemon.store.snapshot().sources[0].observed_at_unix is not None)
        body = get_json(daemon.url + "/v1/protection")[1]
    assert (body["status"], body["protected"]) == ("not-working", False), body
    assert "passed" in body["sources"][0]["reason"], body


def test_healthz_is_starting_for_a_bounded_grace_then_degraded_with_the_reason() -> None:
    # Issue 39, item 5: 70 s after start with the metadata refusing, still "starting".
    # The grace is START_GRACE_SECONDS (30 s), or the staleness bound when shorter.
    from sidecar.host.store import START_GRACE_SECONDS, Store

    now = [1000.0]
    store = Store(["volcengine-esi"], stale_after=90.0, clock=lambda: now[0])
    store.record_failure("volcengine-esi", "metadata service ...: Connection refused")
    now[0] += START_GRACE_SECONDS - 1
    assert store.health().status == "starting"
    now[0] += 2
    health = store.health()
    assert health.status == "degraded", health
    assert health.reason == ("volcengine-esi: no successful poll since start: metadata "
                             "service ...: Connection refused")
    short = Store(["s"], stale_after=6.0, clock=lambda: now[0])  # a shorter bound wins
    now[0] += 7
    assert short.health().status == "degraded"


def test_healthz_on_the_real_daemon_says_why_once_the_grace_is_over(
        refused_metadata: str) -> None:
    with serve_daemon(sources=("volcengine-esi",), metadata_url=refused_metadata,
                      poll_interval=0.5) as daemon:  # staleness bound 1.5 s < 30 s
        wait_for(lambda: get_json(daemon.url + "/healthz")[1]["status"] == "degraded")
        status, body = get_json(daemon.url + "/healthz")
    assert status == 503 and "Connection refused" in body["reason"], body


def test_the_verdict_says_how_late_a_moved_release_is_seen(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Issue 39, item 6: a release an hour away is polled every 5 min (1/12 of the time
    # left), so a move to 45 s away is seen up to 5 min late: the verdict says so.
    from sidecar.tools.emulator import Emulator

    monkeypatch.setenv("VOLCENGINE_ACCESS_KEY", "AKLTprotectionlag000")
    monkeypatch.setenv("VOLCENGINE_SECRET_KEY", "cHJvdGVjdGlvbi1sYWc=")
    with Emulator(access_key="AKLTprotectionlag000", secret_key="cHJvdGVjdGlvbi1sYWc=",
                  region="cn-beijing", instance_id="i-lag0001",
                  scheduled_instance_id="esi-lag0001") as emulator:
        emulator.set_release_in(3600)
        with serve_daemon(api_endpoint=emulator.url, metadata_url=emulator.url,
                          poll_interval=5.0, poll_schedule="adaptive") as daemon:
            body = wait_for(lambda: (b := get_json(daemon.url + "/v1/protection")[1])[
                "detection_lag_seconds"] is not None and b)
            expiry = get_json(daemon.url + "/v1/expiry")[1]
            status = subprocess.run([sys.executable, "-m", "sidecar.cli", "status", "--url",
                                     daemon.url], capture_output=True, text=True, timeout=60)
    lag = body["detection_lag_seconds"]
    assert 0.9 * 300 <= lag <= 1.1 * 300, body  # 1/12 of an hour, +-10 % jitter
    assert body["sources"][0]["detection_lag_seconds"] == lag
    assert expiry["detection_lag_seconds"] == lag, expiry
    assert expiry["notices"][0]["detection_lag_seconds"] == lag, expiry
    said = re.search(r"; a moved deadline is seen within (\d+) s \(the poll interval now\)$",
                     body["sources"][0]["reason"])
    assert said is not None and abs(int(said.group(1)) - lag) <= 1, body
    assert said.group(0)[2:] in status.stdout, status.stdout


@pytest.mark.parametrize("value", ["gcp", "gcp=abc", "gcp=0", "gcp=-1", "gcp=inf", "nope=30",
                                   "auto=30"])
def test_a_nonsense_notice_stops_start_up_naming_the_setting(value: str) -> None:
    with pytest.raises(ConfigError, match=r"invalid --notice value"):
        load_settings({"notice": [value]}, environ={})
    with pytest.raises(ConfigError, match=r"invalid ESI_SIDECAR_NOTICE value"):
        load_settings({}, environ={"ESI_SIDECAR_NOTICE": value})


def test_notice_settings_parse_per_source() -> None:
    settings = load_settings({"notice": ["gce=15", "aws=2m,volcengine-esi=ahead"]}, environ={})
    assert settings.notices == {"gcp": 15.0, "aws": 120.0, "volcengine-esi": None}


def test_esi_sidecar_status_prints_the_verdicts(gce: GcpMetadataEmulator) -> None:
    import subprocess
    import sys

    with serve_daemon(sources=("gcp",), gcp_metadata_url=gce.url, stale_after=30.0) as daemon:
        wait_for(lambda: daemon.store.health().ok)
        report_a_60_s_save(daemon.url)
        wait_for(lambda: gcp_verdict(daemon.url)["status"] != "unknown")
        status = subprocess.run([sys.executable, "-m", "sidecar.cli", "status", "--url",
                                 daemon.url], capture_output=True, text=True, timeout=60)
    lines = status.stdout.splitlines()
    verdicts = lines[lines.index("protection:") + 1:]
    assert verdicts[0].split()[0] == "not-protected"
    assert "gcp: 30 s notice < 65 s step + save" in verdicts[0]
