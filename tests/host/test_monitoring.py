"""The Grafana dashboard and the Prometheus alert rules in deploy/: the rules pass
``promtool check rules`` and their own ``promtool test rules`` cases (Debian's prometheus
package), the dashboard is a well-formed Grafana dashboard, and every metric either names
is exported by a real daemon (with its uploader and a job's events), whose ``/metrics``
passes ``promtool check metrics`` and follows the conventions its lint does not check."""

from __future__ import annotations

import json
import platform
import re
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from daemon_harness import get_json, serve_daemon, wait_for

import sidecar

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "esi-sidecar.rules.yml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "esi-sidecar.rules.test.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "esi-sidecar.json"
METRIC = re.compile(r"\besi_sidecar_[a-z_]+\b")


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        pytest.skip("promtool is not installed (apt-get install prometheus)")
    return found


def test_the_rules_pass_promtool_check() -> None:
    done = subprocess.run([promtool(), "check", "rules", str(RULES)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS: 7 rules found" in done.stdout


def test_each_alert_fires_when_it_should_and_only_then() -> None:
    done = subprocess.run([promtool(), "test", "rules", str(RULE_TESTS)], capture_output=True,
                          text=True, timeout=60, cwd=RULE_TESTS.parent)
    assert done.returncode == 0, done.stdout + done.stderr
    # Every alert has a case.
    import yaml

    alerts = {rule["alert"] for group in yaml.safe_load(RULES.read_text())["groups"]
              for rule in group["rules"]}
    cases = {case["alertname"] for test in yaml.safe_load(RULE_TESTS.read_text())["tests"]
             for case in test["alert_rule_test"]}
    assert alerts == cases


def dashboard() -> dict[str, Any]:
    body: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return body


def test_the_dashboard_is_a_well_formed_grafana_dashboard() -> None:
    board = dashboard()
    assert board["title"] == "esi-sidecar" and board["uid"] == "esi-sidecar"
    assert isinstance(board["schemaVersion"], int) and board["schemaVersion"] >= 36
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["instance"]["type"] == "query"
    assert board["__inputs"][0]["name"] == "DS_PROMETHEUS"
    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids)) >= 10
    for panel in board["panels"]:
        assert panel["type"] in ("stat", "timeseries"), panel["title"]
        assert panel["title"] and panel["description"]
        grid = panel["gridPos"]
        assert grid["x"] >= 0 and grid["w"] > 0 and grid["x"] + grid["w"] <= 24, panel["title"]
        assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}"
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert METRIC.search(target["expr"]), target
            assert '$instance' in target["expr"], target  # the host picker applies
    # Panels do not overlap.
    cells = set()
    for panel in board["panels"]:
        grid = panel["gridPos"]
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in cells, panel["title"]
                cells.add((x, y))


def exported_names(text: str) -> set[str]:
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()[:4]
            names.add(name)
            if kind == "counter":
                names.add(name + "_total")
            if kind == "histogram":
                names.update(name + suffix for suffix in ("_bucket", "_sum", "_count"))
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


@pytest.fixture(scope="module")
def scraped(tmp_path_factory: pytest.TempPathFactory) -> str:
    """``/metrics`` of a real daemon with its uploader and a job's events."""
    root = tmp_path_factory.mktemp("monitoring")
    checkpoints, volume = root / "checkpoints", root / "volume"
    checkpoints.mkdir()
    volume.mkdir()
    with serve_daemon(sources=("static",), expires_at=str(time.time() + 3600),
                      upload_from=checkpoints, upload_to=volume.as_uri(),
                      upload_scan_interval=0.2) as daemon:
        now = time.time()
        events = [
            {"kind": "step-estimate", "job": "host:1", "at_unix": now, "step_seconds": 2.0,
             "save_seconds": 30.0, "budget_seconds": 152.0, "remaining_seconds": 3600.0},
            {"kind": "save-finished", "job": "host:1", "at_unix": now - 60, "step": 9,
             "save": "fallback", "seconds": 3.4},  # SavePolicy.fallback_saves
            {"kind": "save-finished", "job": "host:1", "at_unix": now, "step": 10,
             "save": "final", "seconds": 3.5},
            {"kind": "durable", "job": "host:1", "at_unix": now, "step": 10, "save": "final",
             "lead_seconds": 3500.0},
        ]
        request = urllib.request.Request(daemon.url + "/v1/events",
                                         data=json.dumps(events).encode(), method="POST",
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=5) as response:
            assert response.status == 202
        wait_for(lambda: get_json(daemon.url + "/v1/uploads")[1]["enabled"] is True)
        with urllib.request.urlopen(daemon.url + "/metrics", timeout=5) as response:
            return response.read().decode()


def test_every_metric_the_rules_and_the_dashboard_name_is_exported(scraped: str) -> None:
    exported = exported_names(scraped)
    named = set(METRIC.findall(RULES.read_text()))
    for panel in dashboard()["panels"]:
        for target in panel["targets"]:
            named.update(METRIC.findall(target["expr"]))
    assert len(named) >= 12
    missing = sorted(named - exported)
    assert missing == [], f"named but not exported: {missing}"


def test_the_metrics_pass_promtool_check_metrics(scraped: str) -> None:
    # Its lint: names, units, help present, counters ending in _total.
    done = subprocess.run([promtool(), "check", "metrics"], input=scraped,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and not done.stdout.strip(), done.stdout + done.stderr


def test_times_are_timestamps_and_the_build_and_process_are_exported(scraped: str) -> None:
    exported = exported_names(scraped)
    # Prometheus' convention: when something happened, not how long ago (the dashboard and
    # the rules take time() - the timestamp).
    assert not [name for name in exported if name.endswith("_age_seconds")]
    assert "esi_sidecar_job_last_save_timestamp_seconds" in exported
    assert "esi_sidecar_job_deadline_timestamp_seconds" in exported
    build = [line for line in scraped.splitlines()
             if line.startswith("esi_sidecar_build_info{")]
    assert build == [f'esi_sidecar_build_info{{python="{platform.python_version()}",'
                     f'version="{sidecar.__version__}"}} 1.0']
    if Path("/proc/self/stat").exists():  # the process collector reads /proc (Linux)
        assert {"process_cpu_seconds_total", "process_resident_memory_bytes",
                "process_start_time_seconds", "process_open_fds"} <= exported


def test_every_family_has_a_help_text_that_says_more_than_its_name(scraped: str) -> None:
    families = {line.split()[2] for line in scraped.splitlines() if line.startswith("# TYPE ")}
    helps = dict(line[len("# HELP "):].split(" ", 1) for line in scraped.splitlines()
                 if line.startswith("# HELP "))
    assert len([name for name in families if name.startswith("esi_sidecar_")]) >= 25
    for name in families:
        assert len(helps.get(name, "")) > len(name.split("_", 2)[-1]), name
