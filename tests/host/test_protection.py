"""The protection verdict per source, on the real daemon (issue 24, item 2): the emulated
GCP metadata server, a job reporting a 60 s save through POST /v1/events."""

from __future__ import annotations

import json
import logging
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


def test_the_top_level_protected_holds_while_a_verdict_is_unknown_and_falls_with_one_not(
        gce: GcpMetadataEmulator) -> None:
    # docs/protection.md: ``protected`` is false when any source is not protected; a
    # verdict still unknown (no save time from the job yet) is no such source.
    with serve_daemon(sources=("static", "gcp"), expires_at="2030-01-01T00:00:00Z",
                      gcp_metadata_url=gce.url) as daemon:

        def statuses() -> dict[str, str]:
            body = get_json(daemon.url + "/v1/protection")[1]
            return {v["source"]: v["status"] for v in body["sources"]}

        wait_for(lambda: statuses().keys() == {"static", "gcp"})
        body = get_json(daemon.url + "/v1/protection")[1]
        assert statuses() == {"static": "protected", "gcp": "unknown"}, body
        assert body["protected"] is True, body
        report_a_60_s_save(daemon.url)
        wait_for(lambda: statuses()["gcp"] != "unknown")
        body = get_json(daemon.url + "/v1/protection")[1]
        assert statuses() == {"static": "protected", "gcp": "not-protected"}, body
        assert body["protected"] is False, body


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
