"""``esi-sidecar drill``: a checkpoint durable after the drill deadline is a FAIL, said as
"after" (never a negative "before"), against the real daemon; and a PASS whose own figures
show a late checkpoint (an older daemon counted it) is a FAIL too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from daemon_harness import get_json, serve_daemon, wait_for

from sidecar.cli.drill import EXIT_FAIL, EXIT_PASS, describe_drill, exit_code
from sidecar.train.client import ENV_TOKEN

ROOT = Path(__file__).resolve().parents[2]


def post_event(url: str, event: dict[str, Any]) -> None:
    request = urllib.request.Request(url + "/v1/events", data=json.dumps(event).encode(),
                                     method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=5) as response:
        assert response.status == 202


def test_esi_sidecar_drill_fails_a_checkpoint_durable_after_the_drill_deadline() -> None:
    settings = {"sources": ("static",), "expires_at": repr(time.time() + 3600)}
    with serve_daemon(**settings) as daemon:
        post_event(daemon.url, {"kind": "step-estimate", "job": "trainer:1",
                                "step_seconds": 0.1, "save_seconds": 1.0,
                                "budget_seconds": 20.0, "remaining_seconds": 3600.0})
        env = {key: value for key, value in os.environ.items() if key != ENV_TOKEN}
        env["PYTHONPATH"] = str(ROOT)
        command = subprocess.Popen(
            [sys.executable, "-m", "sidecar.cli", "drill", "--url", daemon.url, "--in", "30",
             "--wait"], env=env, cwd=ROOT, text=True, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE)
        try:
            wait_for(lambda: get_json(daemon.url + "/v1/drill")[1]["drill"], timeout=30)
            post_event(daemon.url, {"kind": "drill", "job": "trainer:1", "step": 41, "drill": {
                "id": "drill-1", "outcome": "durable", "save_seconds": 1.5,
                "upload_seconds": 31.0, "durable_seconds": 32.5, "lead_seconds": -2.5,
                "remaining_seconds": 30.0}})
            out, err = command.communicate(timeout=30)
        finally:
            if command.poll() is None:
                command.kill()
                command.communicate()
    assert command.returncode == EXIT_FAIL, out + err
    assert "drill-1: FAIL - durable 2.5 s after the drill deadline" in out, out
    assert "; 2.5 s after the drill deadline (lead 30.0 s" in out, out
    assert "-2.5 s" not in out, out


def test_a_pass_whose_figures_show_a_late_checkpoint_is_a_fail() -> None:
    # What an older daemon answered for a late "durable" report: PASS.
    drill = {"id": "drill-1", "result": "pass", "verdict": "PASS", "lead_seconds": 30.0,
             "reason": "durable -2.5 s before the drill deadline",
             "figures": {"outcome": "durable", "step": 41, "durable_seconds": 32.5,
                         "lead_seconds": -2.5, "remaining_seconds": 30.0}}
    assert exit_code(drill) == EXIT_FAIL
    assert describe_drill(drill)[0] == "drill-1: FAIL - durable 2.5 s after the drill deadline"
    # The lead alone in time, the save's own figures late: the later one wins.
    inconsistent = {**drill, "figures": {**drill["figures"], "lead_seconds": 1.0}}
    assert exit_code(inconsistent) == EXIT_FAIL
    # In time by every figure: PASS.
    in_time = {**drill, "reason": "durable 12.5 s before the drill deadline",
               "figures": {"outcome": "durable", "durable_seconds": 4.5,
                           "lead_seconds": 12.5, "remaining_seconds": 17.0}}
    assert exit_code(in_time) == EXIT_PASS
    assert describe_drill(in_time)[0].startswith("drill-1: PASS - durable 12.5 s before")
    assert "12.5 s before the drill deadline" in describe_drill(in_time)[1]
